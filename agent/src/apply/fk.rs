//! Foreign keys across nodes: detection of orphans at apply time.
//!
//! Apply sessions run with `session_replication_role = replica`, so
//! PostgreSQL's foreign-key triggers do not fire there (as in its own apply
//! worker): a child row inserted on A while its parent is deleted on B
//! arrives on each node after the other change and leaves an orphan on
//! every node. mm cannot refuse either change without diverging or stalling
//! (each was valid where it was made), so it keeps both, as PGD and Spock
//! do, and says so: after the transaction's changes, before its commit, a
//! check per child row written and per parent row removed looks for
//! orphans, and each one found becomes a `foreign_key_orphan` row of
//! `mm.conflict_log` (counted in status and `/metrics`, logged with relation
//! and key). Only tables that take part in a foreign key pay for it.

use std::sync::Arc;

use mm_proto::pgoutput::{ColumnValue, KeyValue, Message, OldTuple, TupleData};
use tokio_postgres::Client;

use super::relation::LocalRelation;
use super::sql::{key_json, qualified, quote_ident, quote_literal};
use super::{ApplyFailure, Param};

pub const ORPHAN: &str = "foreign_key_orphan";

/// The warning for `n` orphans a transaction's check found in `relation`.
pub fn warn_orphans(relation: &str, n: u64, commit_lsn: mm_proto::Lsn) {
    tracing::warn!(
        relation,
        orphans = n,
        %commit_lsn,
        "foreign key orphan: a row references a parent row that is gone (concurrent insert and delete on two nodes); kept, logged in mm.conflict_log as foreign_key_orphan"
    );
}

/// One foreign-key constraint, from the child's and the parent's side.
#[derive(Debug, Clone)]
pub struct ForeignKey {
    pub constraint: String,
    pub child_display: String,
    pub child_sql: String,
    /// Referencing columns of the child and their types.
    pub child_cols: Vec<String>,
    pub child_types: Vec<String>,
    /// The child's own key (to name an orphan) and its types; empty when
    /// the child has none.
    pub child_key: Vec<String>,
    pub child_key_types: Vec<String>,
    pub parent_display: String,
    pub parent_sql: String,
    /// Referenced columns of the parent, in the order of `child_cols`.
    pub parent_cols: Vec<String>,
}

/// The foreign keys a table takes part in.
#[derive(Debug, Default)]
pub struct ForeignKeys {
    /// This table references these parents.
    pub as_child: Vec<ForeignKey>,
    /// These children reference this table.
    pub as_parent: Vec<ForeignKey>,
}

/// A check to run before the transaction commits.
#[derive(Debug, Clone)]
pub struct FkCheck {
    /// The remote relation oid whose `fks` hold the constraint.
    pub oid: u32,
    pub as_child: bool,
    pub index: usize,
    /// Values after the commit timestamp and LSN (see the SQL builders).
    pub params: Vec<Param>,
}

impl ForeignKeys {
    /// None when the table takes part in no foreign key.
    pub async fn load(client: &Client, relid: u32) -> Result<Option<Arc<Self>>, ApplyFailure> {
        let rows = client
            .query(
                "SELECT con.conname::text, con.conrelid = $1, \
                        cn.nspname::text, cc.relname::text, pn.nspname::text, pc.relname::text, \
                        ARRAY(SELECT a.attname::text FROM unnest(con.conkey) WITH ORDINALITY k(n, i) \
                              JOIN pg_catalog.pg_attribute a ON a.attrelid = con.conrelid AND a.attnum = k.n ORDER BY k.i), \
                        ARRAY(SELECT pg_catalog.format_type(a.atttypid, -1) FROM unnest(con.conkey) WITH ORDINALITY k(n, i) \
                              JOIN pg_catalog.pg_attribute a ON a.attrelid = con.conrelid AND a.attnum = k.n ORDER BY k.i), \
                        ARRAY(SELECT a.attname::text FROM unnest(con.confkey) WITH ORDINALITY k(n, i) \
                              JOIN pg_catalog.pg_attribute a ON a.attrelid = con.confrelid AND a.attnum = k.n ORDER BY k.i), \
                        coalesce(mm.key_columns(con.conrelid), '{}'), \
                        ARRAY(SELECT pg_catalog.format_type(a.atttypid, -1) \
                              FROM unnest(coalesce(mm.key_columns(con.conrelid), '{}')) WITH ORDINALITY k(n, i) \
                              JOIN pg_catalog.pg_attribute a ON a.attrelid = con.conrelid AND a.attname = k.n ORDER BY k.i) \
                 FROM pg_catalog.pg_constraint con \
                 JOIN pg_catalog.pg_class cc ON cc.oid = con.conrelid \
                 JOIN pg_catalog.pg_namespace cn ON cn.oid = cc.relnamespace \
                 JOIN pg_catalog.pg_class pc ON pc.oid = con.confrelid \
                 JOIN pg_catalog.pg_namespace pn ON pn.oid = pc.relnamespace \
                 WHERE con.contype = 'f' AND (con.conrelid = $1 OR con.confrelid = $1)",
                &[&relid],
            )
            .await
            .map_err(|e| ApplyFailure::from_pg(None, &e))?;
        if rows.is_empty() {
            return Ok(None);
        }
        let mut out = ForeignKeys::default();
        for r in rows {
            let get = |i: usize| -> Result<String, ApplyFailure> {
                r.try_get(i)
                    .map_err(|e| ApplyFailure::new(None, format!("foreign keys of {relid}: {e}")))
            };
            let arr = |i: usize| -> Result<Vec<String>, ApplyFailure> {
                r.try_get(i)
                    .map_err(|e| ApplyFailure::new(None, format!("foreign keys of {relid}: {e}")))
            };
            let as_child: bool = r
                .try_get(1)
                .map_err(|e| ApplyFailure::new(None, e.to_string()))?;
            let (cs, ct, ps, pt) = (get(2)?, get(3)?, get(4)?, get(5)?);
            let fk = ForeignKey {
                constraint: get(0)?,
                child_display: format!("{cs}.{ct}"),
                child_sql: qualified(&cs, &ct),
                child_cols: arr(6)?,
                child_types: arr(7)?,
                child_key: arr(9)?,
                child_key_types: arr(10)?,
                parent_display: format!("{ps}.{pt}"),
                parent_sql: qualified(&ps, &pt),
                parent_cols: arr(8)?,
            };
            if as_child {
                out.as_child.push(fk.clone());
            }
            // A self-referencing table is both.
            if !as_child || fk.parent_sql == fk.child_sql {
                out.as_parent.push(fk);
            }
        }
        Ok(Some(Arc::new(out)))
    }
}

fn described(fk: &ForeignKey, parent_key: String) -> String {
    format!(
        "pg_catalog.jsonb_build_object('constraint', {}, 'references', {}, 'parent_key', {parent_key})",
        quote_literal(&fk.constraint),
        quote_literal(&fk.parent_display)
    )
}

const LOG_COLUMNS: &str = "INSERT INTO mm.conflict_log (relation, conflict_type, key, remote_origin, \
     remote_commit_ts, remote_lsn, resolution, remote_tuple)";

/// A child row written by this transaction whose parent is missing:
/// `$1` commit ts, `$2` commit LSN, then the child key values (if any), then
/// the referencing values (all non-NULL: MATCH SIMPLE never orphans a NULL).
pub fn child_check_sql(fk: &ForeignKey, peer: &str) -> String {
    let k = fk.child_key.len();
    let key_cols: Vec<&str> = fk.child_key.iter().map(String::as_str).collect();
    let child_key = if k == 0 {
        "NULL::jsonb".to_owned()
    } else {
        key_json(&key_cols, |i, _| {
            format!("${}::{}", 3 + i, fk.child_key_types[i])
        })
    };
    let fk_param = |i: usize| format!("${}::{}", 3 + k + i, fk.child_types[i]);
    let parent_cols: Vec<&str> = fk.parent_cols.iter().map(String::as_str).collect();
    let parent_key = key_json(&parent_cols, |i, _| fk_param(i));
    let mut parent_match = String::new();
    let mut child_match = String::new();
    for (i, (pc, cc)) in fk.parent_cols.iter().zip(&fk.child_cols).enumerate() {
        if i > 0 {
            parent_match.push_str(" AND ");
            child_match.push_str(" AND ");
        }
        parent_match.push_str(&format!("p.{} = {}", quote_ident(pc), fk_param(i)));
        child_match.push_str(&format!("c.{} = {}", quote_ident(cc), fk_param(i)));
    }
    for (i, kc) in fk.child_key.iter().enumerate() {
        child_match.push_str(&format!(
            " AND c.{} = ${}::{}",
            quote_ident(kc),
            3 + i,
            fk.child_key_types[i]
        ));
    }
    format!(
        "{LOG_COLUMNS} SELECT {}, '{ORPHAN}', {child_key}, {}, $1::timestamptz, $2::pg_lsn, 'kept', {} \
         WHERE NOT EXISTS (SELECT 1 FROM {} AS p WHERE {parent_match}) \
         AND EXISTS (SELECT 1 FROM {} AS c WHERE {child_match})",
        quote_literal(&fk.child_display),
        quote_literal(peer),
        described(fk, parent_key),
        fk.parent_sql,
        fk.child_sql,
    )
}

/// A parent row removed by this transaction that children still reference:
/// one log row per child. `$1` commit ts, `$2` commit LSN, then the
/// referenced values of the removed row.
pub fn parent_check_sql(fk: &ForeignKey, peer: &str) -> String {
    let param = |i: usize| format!("${}::{}", 3 + i, fk.child_types[i]);
    let parent_cols: Vec<&str> = fk.parent_cols.iter().map(String::as_str).collect();
    let parent_key = key_json(&parent_cols, |i, _| param(i));
    let child_key = if fk.child_key.is_empty() {
        "pg_catalog.to_jsonb(c.*)".to_owned()
    } else {
        let cols: Vec<&str> = fk.child_key.iter().map(String::as_str).collect();
        key_json(&cols, |_, c| format!("c.{}", quote_ident(c)))
    };
    let mut child_match = String::new();
    let mut parent_match = String::new();
    for (i, (pc, cc)) in fk.parent_cols.iter().zip(&fk.child_cols).enumerate() {
        if i > 0 {
            child_match.push_str(" AND ");
            parent_match.push_str(" AND ");
        }
        child_match.push_str(&format!("c.{} = {}", quote_ident(cc), param(i)));
        parent_match.push_str(&format!("p.{} = {}", quote_ident(pc), param(i)));
    }
    format!(
        "{LOG_COLUMNS} SELECT {}, '{ORPHAN}', {child_key}, {}, $1::timestamptz, $2::pg_lsn, 'kept', {} \
         FROM {} AS c WHERE {child_match} AND NOT EXISTS (SELECT 1 FROM {} AS p WHERE {parent_match})",
        quote_literal(&fk.child_display),
        quote_literal(peer),
        described(fk, parent_key),
        fk.child_sql,
        fk.parent_sql,
    )
}

fn text_param(v: Option<&ColumnValue>) -> Option<Param> {
    match v {
        Some(ColumnValue::Text(b)) => Some(Param::Text(b.clone())),
        _ => None,
    }
}

/// The checks one change needs (none for tables outside foreign keys).
pub fn checks_for(rel: &LocalRelation, msg: &Message) -> Vec<FkCheck> {
    match msg {
        Message::Insert(i) => checks(rel, Some(&i.new), None),
        Message::Update(u) => checks(rel, Some(&u.new), u.old.as_ref()),
        Message::Delete(d) => checks(rel, None, Some(&d.old)),
        _ => Vec::new(),
    }
}

/// The checks for a row written (`new`) and/or removed (`old`: a delete, or
/// an update that changed the key).
pub fn checks(
    rel: &LocalRelation,
    written: Option<&TupleData>,
    old: Option<&OldTuple>,
) -> Vec<FkCheck> {
    let Some(fks) = &rel.fks else {
        return Vec::new();
    };
    let pos = |name: &str| rel.local_names.iter().position(|n| n == name);
    let mut out = Vec::new();
    // Child side: the row as written.
    if let Some(new) = written {
        for (index, fk) in fks.as_child.iter().enumerate() {
            let mut params = Vec::new();
            let key: Option<Vec<Param>> = fk
                .child_key
                .iter()
                .map(|c| pos(c).and_then(|i| text_param(new.columns.get(i))))
                .collect();
            let vals: Option<Vec<Param>> = fk
                .child_cols
                .iter()
                .map(|c| pos(c).and_then(|i| text_param(new.columns.get(i))))
                .collect();
            // A NULL or unsent referencing value: nothing to check.
            let (Some(key), Some(vals)) = (key, vals) else {
                continue;
            };
            params.extend(key);
            params.extend(vals);
            out.push(FkCheck {
                oid: rel.remote.oid,
                as_child: true,
                index,
                params,
            });
        }
    }
    // Parent side: the row removed (deleted, or its key changed).
    if let Some(old) = old.map(|o| old_values(rel, o)) {
        for (index, fk) in fks.as_parent.iter().enumerate() {
            let vals: Option<Vec<Param>> = fk
                .parent_cols
                .iter()
                .map(|c| pos(c).and_then(|i| text_param(old.get(i).and_then(Option::as_ref))))
                .collect();
            if let Some(params) = vals {
                out.push(FkCheck {
                    oid: rel.remote.oid,
                    as_child: false,
                    index,
                    params,
                });
            }
        }
    }
    out
}

/// The old row's values as far as sent (a key-only old tuple has the key).
pub(super) fn old_values(rel: &LocalRelation, old: &OldTuple) -> Vec<Option<ColumnValue>> {
    match old {
        OldTuple::Full(t) => t.columns.iter().cloned().map(Some).collect(),
        OldTuple::Key(k) => match k.values(&rel.remote) {
            Ok(it) => it
                .map(|v| match v {
                    KeyValue::Key(c) => Some(c.clone()),
                    KeyValue::NotSent => None,
                })
                .collect(),
            Err(_) => Vec::new(),
        },
    }
}
