//! Tuple mapping: pgoutput's row images to statement parameters and to the
//! locator that finds the target row. Values stay in the publisher's text
//! format (`param.rs` says why); nothing here touches the database.

use mm_proto::pgoutput::{ColumnValue, KeyValue, OldTuple, TupleData};

use super::relation::LocalRelation;
use super::sql::Locator;
use super::{ApplyFailure, Param};

pub(super) fn value(v: &ColumnValue, rel: &str, col: &str) -> Result<Param, ApplyFailure> {
    match v {
        ColumnValue::Null => Ok(Param::Null),
        ColumnValue::Text(b) => Ok(Param::Text(b.clone())),
        ColumnValue::Binary(_) => Err(ApplyFailure::new(
            Some(rel),
            format!(
                "column \"{col}\" arrived in binary format, which this stream did not negotiate"
            ),
        )),
        ColumnValue::UnchangedToast => Err(ApplyFailure::new(
            Some(rel),
            format!("column \"{col}\" arrived as 'unchanged TOAST' where a full value is required"),
        )),
    }
}

/// Columns an update left untouched (unchanged TOAST): never SET.
pub(super) fn unchanged_mask(tuple: &TupleData) -> Vec<bool> {
    tuple
        .columns
        .iter()
        .map(|c| matches!(c, ColumnValue::UnchangedToast))
        .collect()
}

pub(super) fn column_count(rel: &LocalRelation, got: usize) -> ApplyFailure {
    ApplyFailure::new(
        Some(&*rel.display),
        format!(
            "tuple has {got} columns but the RELATION message described {}",
            rel.local_names.len()
        ),
    )
}

/// Parameters for every column of `tuple`, skipping those marked in `skip`.
pub(super) fn tuple_params(
    tuple: &TupleData,
    rel: &LocalRelation,
    skip: Option<&[bool]>,
) -> Result<Vec<Param>, ApplyFailure> {
    if tuple.columns.len() != rel.local_names.len() {
        return Err(column_count(rel, tuple.columns.len()));
    }
    let mut out = Vec::with_capacity(tuple.columns.len());
    for (i, (v, name)) in tuple.columns.iter().zip(&rel.local_names).enumerate() {
        if skip.is_some_and(|m| m.get(i).copied().unwrap_or(false)) {
            continue;
        }
        out.push(value(v, &rel.display, name)?);
    }
    Ok(out)
}

/// The locator restricted to the columns not masked out.
pub(super) fn masked_locator(rel: &LocalRelation, mask: &[bool]) -> Locator {
    match &rel.locator {
        Locator::Key(k) => Locator::Key(k.clone()),
        Locator::AllColumns(cols) => Locator::AllColumns(
            cols.iter()
                .zip(mask.iter().chain(std::iter::repeat(&false)))
                .filter(|(_, m)| !**m)
                .map(|(c, _)| c.clone())
                .collect(),
        ),
    }
}

/// Values that find the target row: the local key taken from the old tuple
/// (or, for an update that did not change the key, the new one); or, for
/// REPLICA IDENTITY FULL without a key, every column of the old row except
/// unchanged-TOAST ones. Returns (columns left out of the match, params).
pub(super) fn locate(
    rel: &LocalRelation,
    old: Option<&OldTuple>,
    new: Option<&TupleData>,
) -> Result<(Vec<bool>, Vec<Param>), ApplyFailure> {
    match &rel.locator {
        Locator::Key(names) => {
            let mut params = Vec::with_capacity(rel.key_remote.len());
            for (&idx, name) in rel.key_remote.iter().zip(names) {
                let v = match old {
                    Some(OldTuple::Full(t)) => t.columns.get(idx),
                    Some(OldTuple::Key(k)) => match k.values(&rel.remote) {
                        Ok(mut vals) => match vals.nth(idx) {
                            Some(KeyValue::Key(v)) => Some(v),
                            _ => None,
                        },
                        Err(e) => {
                            return Err(ApplyFailure::new(Some(&*rel.display), e.to_string()));
                        }
                    },
                    None => new.and_then(|n| n.columns.get(idx)),
                };
                let Some(v) = v else {
                    return Err(ApplyFailure::new(
                        Some(&*rel.display),
                        format!(
                            "the publisher did not send key column \"{name}\" needed to find the row"
                        ),
                    ));
                };
                params.push(value(v, &rel.display, name)?);
            }
            Ok((Vec::new(), params))
        }
        Locator::AllColumns(_) => {
            let Some(OldTuple::Full(t)) = old else {
                return Err(ApplyFailure::new(
                    Some(&*rel.display),
                    "no local key and the publisher sent no full old row: cannot find the target row",
                ));
            };
            if t.columns.len() != rel.local_names.len() {
                return Err(column_count(rel, t.columns.len()));
            }
            let mask: Vec<bool> = t
                .columns
                .iter()
                .map(|c| matches!(c, ColumnValue::UnchangedToast))
                .collect();
            let params = tuple_params(t, rel, Some(&mask))?;
            Ok((mask, params))
        }
    }
}
