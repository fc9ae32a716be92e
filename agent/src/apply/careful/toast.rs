//! Unchanged TOAST columns on the careful path: an UPDATE the publisher
//! sent without a large column it did not change is completed from the
//! local row when that row is the same version, or from the row's origin.

use chrono::{DateTime, Utc};
use mm_proto::pgoutput::{ColumnValue, TupleData};
use serde_json::Value;

use crate::apply::relation::LocalRelation;
use crate::apply::sql::{self, Locator};
use crate::apply::tuple::unchanged_mask;
use crate::apply::{Applier, ApplyFailure, Param};

use super::{OriginRow, fail, params_ref};

impl Applier {
    /// The incoming row in full, for a conflicting update that left
    /// TOASTed columns unchanged: their values are the publisher's row's,
    /// which this node may not hold (its own version differs, or the row is
    /// gone here). Read from the publisher by key, and used only if that row
    /// is this change's version or newer (newer changes will arrive after
    /// it and are applied on top).
    pub(in crate::apply) async fn fetch_unchanged(
        &mut self,
        rel_oid: u32,
        new: &TupleData,
        rts: DateTime<Utc>,
    ) -> Result<OriginRow, ApplyFailure> {
        let rel = self.rel(rel_oid)?;
        let Locator::Key(keys) = &rel.locator else {
            return Ok(OriginRow::Unavailable(
                "the table has no key to find the row on its origin by".into(),
            ));
        };
        let missing: Vec<usize> = new
            .columns
            .iter()
            .enumerate()
            .filter(|(_, c)| matches!(c, ColumnValue::UnchangedToast))
            .map(|(i, _)| i)
            .collect();
        let mut cols = String::new();
        for &i in &missing {
            cols.push_str(&format!(
                "r.{}::text, ",
                sql::quote_ident(&rel.local_names[i])
            ));
        }
        let mut cond = String::new();
        let mut params = Vec::new();
        for (n, (&i, k)) in rel.key_remote.iter().zip(keys).enumerate() {
            let Some(ColumnValue::Text(b)) = new.columns.get(i) else {
                return Ok(OriginRow::Unavailable(format!("key column {k} not sent")));
            };
            params.push(Param::Text(b.clone()));
            if n > 0 {
                cond.push_str(" AND ");
            }
            cond.push_str(&format!(
                "r.{} = ${}::{}",
                sql::quote_ident(k),
                n + 1,
                rel.local_types[i]
            ));
        }
        let text = format!(
            "SELECT {cols}o.\"timestamp\" FROM {} AS r \
             LEFT JOIN LATERAL pg_catalog.pg_xact_commit_timestamp_origin(r.xmin) o ON true WHERE {cond}",
            rel.table_sql
        );
        let display = rel.display.to_string();
        if self.origin_client.is_none() {
            let c = crate::pg::connect(&self.ctx.peer_dsn, self.ctx.peer_password.as_deref())
                .await
                .map_err(|e| ApplyFailure {
                    sqlstate: Some("MM002".into()),
                    ..ApplyFailure::new(
                        Some(&display),
                        format!("reading unchanged TOAST values from {}: {e}", self.ctx.peer),
                    )
                })?;
            self.origin_client = Some(c);
        }
        let Some(client) = self.origin_client.as_ref() else {
            return Ok(OriginRow::Unavailable("no connection".into()));
        };
        let rows = match client.query(&text, &params_ref(&params)).await {
            Ok(r) => r,
            Err(e) => {
                self.origin_client = None;
                return Err(ApplyFailure {
                    sqlstate: Some("MM002".into()),
                    ..ApplyFailure::new(
                        Some(&display),
                        format!("reading unchanged TOAST values from {}: {e}", self.ctx.peer),
                    )
                });
            }
        };
        let Some(row) = rows.first() else {
            return Ok(OriginRow::Gone);
        };
        let ts: Option<DateTime<Utc>> = row
            .try_get(missing.len())
            .map_err(|e| ApplyFailure::new(Some(&display), e.to_string()))?;
        if ts.is_none_or(|t| t < rts) {
            return Ok(OriginRow::Unavailable(format!(
                "the row on {} is older than the change",
                self.ctx.peer
            )));
        }
        let mut full = new.clone();
        for (n, &i) in missing.iter().enumerate() {
            let v: Option<String> = row
                .try_get(n)
                .map_err(|e| ApplyFailure::new(Some(&display), e.to_string()))?;
            full.columns[i] = match v {
                Some(v) => ColumnValue::Text(bytes::Bytes::from(v)),
                None => ColumnValue::Null,
            };
        }
        Ok(OriginRow::Fetched(full))
    }

    /// Unchanged-TOAST columns of `new` filled with the local row's values
    /// (the row at `at`, `tableoid:ctid`): right when that row is the
    /// version the publisher changed (no conflict with it).
    pub(super) async fn complete_from_local(
        &self,
        rel: &LocalRelation,
        new: &TupleData,
        at: &str,
    ) -> Result<TupleData, ApplyFailure> {
        let missing: Vec<usize> = unchanged_mask(new)
            .iter()
            .enumerate()
            .filter(|(_, u)| **u)
            .map(|(i, _)| i)
            .collect();
        let cols: Vec<String> = missing
            .iter()
            .map(|&i| format!("r.{}::text", sql::quote_ident(&rel.local_names[i])))
            .collect();
        let text = format!(
            "SELECT {} FROM {} AS r WHERE {}",
            cols.join(", "),
            rel.table_sql,
            sql::at_row(1)
        );
        let pg = |e: tokio_postgres::Error| ApplyFailure::from_pg(Some(&*rel.display), &e);
        let stmt = self.prepared(&text).await.map_err(pg)?;
        let row = self
            .client
            .query_one(&stmt, &params_ref(&[Param::text(at.to_owned())]))
            .await
            .map_err(pg)?;
        let mut full = new.clone();
        for (n, &i) in missing.iter().enumerate() {
            let v: Option<String> = row.try_get(n).map_err(|e| fail(rel, e.to_string()))?;
            full.columns[i] = match v {
                Some(v) => ColumnValue::Text(bytes::Bytes::from(v)),
                None => ColumnValue::Null,
            };
        }
        Ok(full)
    }

    /// The MM002 failure for an update whose new row must be written whole
    /// but whose unchanged-TOAST values nobody can give yet.
    pub(super) fn toast_unavailable(
        rel: &LocalRelation,
        kind: &str,
        key: Option<&Value>,
        new: &TupleData,
    ) -> ApplyFailure {
        let unsent: Vec<&str> = rel
            .local_names
            .iter()
            .zip(unchanged_mask(new))
            .filter(|(_, u)| *u)
            .map(|(n, _)| n.as_str())
            .collect();
        ApplyFailure {
            // May pass by itself (the row can still arrive from its origin
            // through a third node), so wait-sync keeps waiting.
            sqlstate: Some("MM002".to_owned()),
            ..fail(
                rel,
                format!(
                    "{kind}: key {} must be written as a new row, but the publisher sent columns {} \
                     as unchanged TOAST (values not in the stream) and its row is not available; \
                     NOT writing NULL for them. Unresolved: waiting for the row to arrive from another \
                     node (retrying), or `mmctl skip` this transaction",
                    key.map_or("?".into(), Value::to_string),
                    unsent.join(", ")
                ),
            )
        }
    }
}
