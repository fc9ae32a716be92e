//! The careful path's reads and writes of local state: the rows a change
//! touches with their versions (origin and commit timestamp of their
//! xmin), the key's tombstone and the table's truncate, locked for the
//! rest of the transaction; and its writes, sent as deferred statements
//! whose replies are read before COMMIT.

use std::sync::Arc;

use mm_proto::pgoutput::{ColumnValue, KeyValue, OldTuple};
use serde_json::Value;

use crate::apply::relation::LocalRelation;
use crate::apply::sql::{self, Locator};
use crate::apply::tuple::column_count;
use crate::apply::{Applier, ApplyFailure, Param};

use super::{Version, fail, params_ref};

impl Applier {
    pub(super) async fn query_versions(
        &self,
        text: &str,
        params: &[Param],
        rel: &LocalRelation,
    ) -> Result<Vec<Version>, ApplyFailure> {
        let pg = |e: tokio_postgres::Error| ApplyFailure::from_pg(Some(&*rel.display), &e);
        let stmt = self.prepared(text).await.map_err(pg)?;
        let rows = self
            .client
            .query(&stmt, &params_ref(params))
            .await
            .map_err(pg)?;
        let mut out = Vec::with_capacity(rows.len());
        for r in rows {
            out.push(Version {
                ctid: r.try_get(0).map_err(|e| fail(rel, e.to_string()))?,
                row: r.try_get(1).map_err(|e| fail(rel, e.to_string()))?,
                roident: r.try_get(2).map_err(|e| fail(rel, e.to_string()))?,
                ts: r.try_get(3).map_err(|e| fail(rel, e.to_string()))?,
                this_txn: r
                    .try_get::<_, Option<bool>>(4)
                    .map_err(|e| fail(rel, e.to_string()))?
                    .unwrap_or(false),
            });
        }
        Ok(out)
    }

    /// The locked target row, found by `loc` with `params`.
    pub(in crate::apply) async fn fetch_target(
        &self,
        rel: &LocalRelation,
        loc: &Locator,
        params: &[Param],
    ) -> Result<Option<Version>, ApplyFailure> {
        let text = sql::fetch_rows(&rel.table_sql, &sql::where_alias(loc, 1));
        Ok(self
            .query_versions(&text, params, rel)
            .await?
            .into_iter()
            .next())
    }

    /// Other rows the new tuple would collide with on a unique index.
    pub(super) async fn fetch_collisions(
        &self,
        rel: &LocalRelation,
        new: &[ColumnValue],
        except: Option<&str>,
    ) -> Result<Vec<Version>, ApplyFailure> {
        let mut found: Vec<Version> = Vec::new();
        for idx in &rel.unique_indexes {
            let mut params = Vec::with_capacity(idx.len());
            let mut cond = String::new();
            let mut usable = true;
            for (n, &i) in idx.iter().enumerate() {
                match new.get(i) {
                    Some(ColumnValue::Text(b)) => params.push(Param::Text(b.clone())),
                    // NULLs never collide; unsent values cannot be checked.
                    _ => {
                        usable = false;
                        break;
                    }
                }
                if n > 0 {
                    cond.push_str(" AND ");
                }
                cond.push_str(&format!(
                    "r.{} = ${}::{}",
                    sql::quote_ident(&rel.local_names[i]),
                    n + 1,
                    rel.local_types[i]
                ));
            }
            if !usable {
                continue;
            }
            let text = sql::fetch_rows(&rel.table_sql, &cond);
            for v in self.query_versions(&text, &params, rel).await? {
                if v.ctid.as_deref() == except || found.iter().any(|f| f.ctid == v.ctid) {
                    continue;
                }
                found.push(v);
            }
        }
        Ok(found)
    }

    pub(super) async fn fetch_tombstone(
        &self,
        rel: &LocalRelation,
        key: &[Param],
    ) -> Result<Option<Version>, ApplyFailure> {
        let Some(names) = rel.key_names() else {
            return Ok(None);
        };
        let text = sql::tombstone_lookup(rel.relid, &names, &rel.key_types());
        self.fetch_marker(rel, &text, key).await
    }

    /// The table's truncate version, if it was ever truncated.
    pub(super) async fn fetch_truncate(
        &self,
        rel: &LocalRelation,
    ) -> Result<Option<Version>, ApplyFailure> {
        self.fetch_marker(rel, &sql::truncate_lookup(rel.relid), &[])
            .await
    }

    /// A row-less version (a tombstone or a truncate): `(roident, ts)` from
    /// the first row of `text`, if any.
    pub(super) async fn fetch_marker(
        &self,
        rel: &LocalRelation,
        text: &str,
        params: &[Param],
    ) -> Result<Option<Version>, ApplyFailure> {
        let pg = |e: tokio_postgres::Error| ApplyFailure::from_pg(Some(&*rel.display), &e);
        let stmt = self.prepared(text).await.map_err(pg)?;
        let rows = self
            .client
            .query(&stmt, &params_ref(params))
            .await
            .map_err(pg)?;
        let Some(r) = rows.first() else {
            return Ok(None);
        };
        Ok(Some(Version {
            ctid: None,
            row: None,
            roident: r.try_get(0).map_err(|e| fail(rel, e.to_string()))?,
            ts: r.try_get(1).map_err(|e| fail(rel, e.to_string()))?,
            this_txn: false,
        }))
    }

    pub(super) async fn write_tombstone(
        &self,
        rel: &LocalRelation,
        key: &[Param],
    ) -> Result<(), ApplyFailure> {
        let Some(names) = rel.key_names() else {
            return Ok(());
        };
        let text = sql::tombstone_upsert(rel.relid, &names, &rel.key_types());
        self.exec(rel, &text, key).await
    }

    /// Sends a write, deferred (`deferred.rs`): its reply is read with the
    /// transaction's last round.
    pub(super) async fn exec(
        &self,
        rel: &LocalRelation,
        text: &str,
        params: &[Param],
    ) -> Result<(), ApplyFailure> {
        self.send_write(rel, text, params, false).await
    }

    /// `exec` of the change itself: its rows count as rows applied.
    pub(super) async fn exec_row(
        &self,
        rel: &LocalRelation,
        text: &str,
        params: &[Param],
    ) -> Result<(), ApplyFailure> {
        self.send_write(rel, text, params, true).await
    }

    pub(super) async fn send_write(
        &self,
        rel: &LocalRelation,
        text: &str,
        params: &[Param],
        counted: bool,
    ) -> Result<(), ApplyFailure> {
        let pg = |e: tokio_postgres::Error| ApplyFailure::from_pg(Some(&*rel.display), &e);
        let stmt = self.prepared(text).await.map_err(pg)?;
        self.deferred.begun().await?;
        self.deferred.send(
            &self.client,
            &stmt,
            params.to_vec(),
            Some(Arc::clone(&rel.display)),
            counted,
        );
        Ok(())
    }

    /// A tuple as the jsonb object a local row of the table would be;
    /// columns not sent are left out.
    pub(in crate::apply) async fn tuple_json(
        &self,
        rel: &LocalRelation,
        cols: &[ColumnValue],
        sent: impl Fn(usize) -> bool,
    ) -> Result<Value, ApplyFailure> {
        if cols.len() != rel.local_names.len() {
            return Err(column_count(rel, cols.len()));
        }
        let names: Vec<&str> = rel.local_names.iter().map(String::as_str).collect();
        let types: Vec<&str> = rel.local_types.iter().map(String::as_str).collect();
        let params: Vec<Param> = cols
            .iter()
            .enumerate()
            .map(|(i, c)| match c {
                ColumnValue::Text(b) if sent(i) => Param::Text(b.clone()),
                _ => Param::Null,
            })
            .collect();
        let pg = |e: tokio_postgres::Error| ApplyFailure::from_pg(Some(&*rel.display), &e);
        let stmt = self
            .prepared(&sql::row_json(&names, &types))
            .await
            .map_err(pg)?;
        let row = self
            .client
            .query_one(&stmt, &params_ref(&params))
            .await
            .map_err(pg)?;
        let mut v: Value = row.try_get(0).map_err(|e| fail(rel, e.to_string()))?;
        if let Value::Object(m) = &mut v {
            for (i, c) in cols.iter().enumerate() {
                let absent =
                    !sent(i) || matches!(c, ColumnValue::UnchangedToast | ColumnValue::Binary(_));
                if absent {
                    m.remove(&rel.local_names[i]);
                }
            }
        }
        Ok(v)
    }

    /// An old tuple as jsonb: all of it (REPLICA IDENTITY FULL) or its key
    /// columns only (the others were not sent).
    pub(super) async fn old_json(
        &self,
        rel: &LocalRelation,
        old: &OldTuple,
    ) -> Result<Value, ApplyFailure> {
        match old {
            OldTuple::Full(t) => self.tuple_json(rel, &t.columns, |_| true).await,
            OldTuple::Key(k) => {
                let vals: Vec<ColumnValue> = match k.values(&rel.remote) {
                    Ok(it) => it
                        .map(|v| match v {
                            KeyValue::Key(c) => c.clone(),
                            KeyValue::NotSent => ColumnValue::Null,
                        })
                        .collect(),
                    Err(e) => return Err(fail(rel, e.to_string())),
                };
                let sent: Vec<bool> = (0..vals.len())
                    .map(|i| rel.key_remote.contains(&i))
                    .collect();
                self.tuple_json(rel, &vals, |i| sent[i]).await
            }
        }
    }
}
