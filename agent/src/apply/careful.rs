//! The careful path: a remote transaction that met a conflict on the fast
//! path is applied again here, one statement at a time, with detection,
//! resolution and logging (the rules are in `conflict`). Only transactions
//! that conflict come here; everything else stays pipelined.
//!
//! For every change: lock the local row(s) it touches, read their version
//! (origin and commit timestamp of their xmin) or the key's tombstone,
//! classify, and either apply it (same origin, this transaction, routine) or
//! ask the table's resolver and carry the decision out. The conflict log row
//! is written in the same local transaction, so a resolution and its record
//! commit or vanish together.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use mm_proto::pgoutput::{
    ColumnValue, Delete, Insert, KeyValue, Message, OldTuple, TupleData, Update,
};
use serde_json::Value;
use tokio_postgres::types::ToSql;

use super::applier::{
    TxnBody, TxnMeta, column_count, locate, masked_locator, tuple_params, unchanged_mask,
};
use super::pipeline::Done;
use super::relation::LocalRelation;
use super::sql::{self, Locator};
use super::{Applier, ApplyFailure, Param};
use crate::conflict::{Conflict, ConflictType, Resolution, ResolverChoice, resolution_label};

/// A local row (or a tombstone) and its version.
#[derive(Debug, Clone)]
struct Version {
    /// `None` for a tombstone.
    ctid: Option<String>,
    row: Option<Value>,
    roident: Option<u32>,
    ts: Option<DateTime<Utc>>,
    /// Written by the local transaction we are in (this remote transaction).
    this_txn: bool,
}

/// What one careful transaction did, for status and metrics.
#[derive(Default)]
struct Outcome {
    rows: u64,
    conflicts: Vec<(&'static str, Arc<str>)>,
}

fn fail(rel: &LocalRelation, msg: impl Into<String>) -> ApplyFailure {
    ApplyFailure::new(Some(&*rel.display), msg)
}

fn params_ref(p: &[Param]) -> Vec<&(dyn ToSql + Sync)> {
    p.iter().map(|v| v as &(dyn ToSql + Sync)).collect()
}

impl Applier {
    /// Applies one transaction with conflict resolution and commits it.
    pub(super) async fn apply_careful(
        &mut self,
        meta: &TxnMeta,
        body: &TxnBody,
    ) -> Result<(), ApplyFailure> {
        let pg = |e: tokio_postgres::Error| ApplyFailure::from_pg(None, &e);
        let mut src = body.open()?;
        self.client.batch_execute("BEGIN").await.map_err(pg)?;
        let mut out = Outcome::default();
        let r = async {
            let mut fk_checks = Vec::new();
            while let Some(msg) = src.next_message()? {
                if let Message::Insert(Insert { relation_oid, .. })
                | Message::Update(Update { relation_oid, .. })
                | Message::Delete(Delete { relation_oid, .. }) = &msg
                {
                    fk_checks.extend(super::fk::checks_for(self.rel(*relation_oid)?, &msg));
                }
                match msg {
                    Message::Relation(r) => self.relation(r).await?,
                    Message::Insert(i) => self.careful_insert(meta, i, &mut out).await?,
                    Message::Update(u) => self.careful_update(meta, u, &mut out).await?,
                    Message::Delete(d) => self.careful_delete(meta, d, &mut out).await?,
                    Message::Truncate(t) => {
                        let (_, params) = self.truncate_params(meta, &t)?;
                        self.client
                            .execute(sql::APPLY_TRUNCATE, &params_ref(&params))
                            .await
                            .map_err(pg)?;
                    }
                    Message::Message(m) if super::applier::is_partition_truncate(&m) => {
                        let params = super::applier::partition_truncate_params(&m, meta);
                        self.client
                            .execute(sql::APPLY_PARTITION_TRUNCATE, &params_ref(&params))
                            .await
                            .map_err(pg)?;
                    }
                    Message::Type(_) | Message::Message(_) | Message::Origin(_) => {}
                    other => {
                        return Err(ApplyFailure::new(
                            None,
                            format!("unexpected message inside a transaction: {}", other.name()),
                        ));
                    }
                }
            }
            for check in fk_checks {
                let (stmt, child) = self.fk_statement(None, &check).await?;
                let mut params = vec![
                    Param::timestamptz(meta.commit_ts.0),
                    Param::text(meta.commit_lsn.to_string()),
                ];
                params.extend(check.params);
                let n = self
                    .client
                    .execute(&stmt, &params_ref(&params))
                    .await
                    .map_err(|e| ApplyFailure::from_pg(Some(&child), &e))?;
                if n > 0 {
                    super::fk::warn_orphans(&child, n, meta.commit_lsn);
                }
                for _ in 0..n {
                    out.conflicts.push((super::fk::ORPHAN, Arc::clone(&child)));
                }
            }
            self.client
                .execute(
                    "SELECT mm.advance_progress($1, $2::pg_lsn, $3::pg_lsn, $4::timestamptz)",
                    &params_ref(&self.progress_params(meta)),
                )
                .await
                .map_err(pg)?;
            self.client.batch_execute("COMMIT").await.map_err(pg)?;
            Ok(())
        }
        .await;
        if let Err(mut f) = r {
            // BEGIN went through: end the aborted transaction here.
            let _ = self.client.batch_execute("ROLLBACK").await;
            f.txn = Some(*meta);
            f.conflict = false;
            return Err(f);
        }
        for (ty, rel) in &out.conflicts {
            tracing::info!(conflict = ty, relation = %rel, xid = meta.xid, commit_lsn = %meta.commit_lsn, "conflict resolved");
        }
        self.last_applied = self.last_applied.max(meta.end_lsn);
        self.push_done(Done {
            meta: *meta,
            rows: out.rows,
            conflicts: out.conflicts,
            routine: 0,
        });
        Ok(())
    }

    async fn query_versions(
        &self,
        text: &str,
        params: &[Param],
        rel: &LocalRelation,
    ) -> Result<Vec<Version>, ApplyFailure> {
        let rows = self
            .client
            .query(text, &params_ref(params))
            .await
            .map_err(|e| ApplyFailure::from_pg(Some(&*rel.display), &e))?;
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
    async fn fetch_target(
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
    async fn fetch_collisions(
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

    async fn fetch_tombstone(
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
    async fn fetch_truncate(&self, rel: &LocalRelation) -> Result<Option<Version>, ApplyFailure> {
        self.fetch_marker(rel, &sql::truncate_lookup(rel.relid), &[])
            .await
    }

    /// A row-less version (a tombstone or a truncate): `(roident, ts)` from
    /// the first row of `text`, if any.
    async fn fetch_marker(
        &self,
        rel: &LocalRelation,
        text: &str,
        params: &[Param],
    ) -> Result<Option<Version>, ApplyFailure> {
        let rows = self
            .client
            .query(text, &params_ref(params))
            .await
            .map_err(|e| ApplyFailure::from_pg(Some(&*rel.display), &e))?;
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

    /// A change older than (or as old as) the last TRUNCATE of its table is
    /// discarded, whatever the resolver: the truncate wins over every older
    /// change from any origin, on every node (and `mm.apply_truncate` keeps
    /// rows newer than it), so all nodes end alike. Logged like a change
    /// meeting a tombstone. True when the change was discarded.
    #[allow(clippy::too_many_arguments)]
    async fn discard_if_truncated(
        &mut self,
        meta: &TxnMeta,
        oid: u32,
        kind: ConflictType,
        remote_old: Option<&OldTuple>,
        remote_new: Option<&TupleData>,
        out: &mut Outcome,
    ) -> Result<bool, ApplyFailure> {
        let rel = self.rel(oid)?;
        let Some(tr) = self.fetch_truncate(rel).await? else {
            return Ok(false);
        };
        let older = match tr.ts {
            Some(ts) => remote_ts(meta) <= ts && !tr.this_txn,
            None => false,
        };
        if !older {
            return Ok(false);
        }
        let old_json = match remote_old {
            Some(o) => Some(self.old_json(rel, o).await?),
            None => None,
        };
        let new_json = match remote_new {
            Some(n) => Some(self.tuple_json(rel, &n.columns, |_| true).await?),
            None => None,
        };
        let key = old_json
            .as_ref()
            .or(new_json.as_ref())
            .and_then(|v| key_of(rel, v));
        let c = self.conflict(kind, rel, meta, Some(&tr), old_json, new_json);
        self.log_conflict(rel, meta, &c, key, "keep_local", out)
            .await?;
        Ok(true)
    }

    async fn write_tombstone(
        &self,
        rel: &LocalRelation,
        key: &[Param],
    ) -> Result<(), ApplyFailure> {
        let Some(names) = rel.key_names() else {
            return Ok(());
        };
        let text = sql::tombstone_upsert(rel.relid, &names, &rel.key_types());
        self.exec(rel, &text, key).await.map(|_| ())
    }

    async fn exec(
        &self,
        rel: &LocalRelation,
        text: &str,
        params: &[Param],
    ) -> Result<u64, ApplyFailure> {
        self.client
            .execute(text, &params_ref(params))
            .await
            .map_err(|e| ApplyFailure::from_pg(Some(&*rel.display), &e))
    }

    /// A tuple as the jsonb object a local row of the table would be;
    /// columns not sent are left out.
    async fn tuple_json(
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
        let row = self
            .client
            .query_one(&sql::row_json(&names, &types), &params_ref(&params))
            .await
            .map_err(|e| ApplyFailure::from_pg(Some(&*rel.display), &e))?;
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
    async fn old_json(&self, rel: &LocalRelation, old: &OldTuple) -> Result<Value, ApplyFailure> {
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

    fn origin_name(&self, v: &Version) -> Option<String> {
        v.roident
            .map(|id| {
                self.origins
                    .get(&id)
                    .cloned()
                    .unwrap_or_else(|| format!("origin {id}"))
            })
            .or_else(|| Some(self.ctx.local_node.clone()))
    }

    /// The routine test (`conflict::routine`, the same rule `mm.routine`
    /// applies on the fast path).
    fn no_conflict(&self, v: &Version, remote_ts: DateTime<Utc>) -> bool {
        let facts = crate::conflict::routine::VersionFacts {
            roident: v.roident,
            ts: v.ts,
            this_txn: v.this_txn,
        };
        crate::conflict::routine::no_resolver_needed(
            &facts,
            self.peer_roident,
            |id| {
                let node = self.origins.get(&id)?;
                self.wm.map.get(node).copied()
            },
            remote_ts,
        )
    }

    /// Counts a no-conflict change to another origin's version as routine.
    fn note_routine(&mut self, v: &Version) {
        if !v.this_txn && v.roident != Some(self.peer_roident) {
            self.count_routine();
        }
    }

    /// Asks the table's resolver.
    async fn resolve(&self, rel: &LocalRelation, c: &Conflict) -> Result<Resolution, ApplyFailure> {
        match self.ctx.resolvers.for_table(&rel.display) {
            ResolverChoice::Rust(r) => Ok(r.resolve(c)),
            ResolverChoice::Sql { function } => {
                let row = self
                    .client
                    .query_one(
                        &format!("SELECT {function}($1::jsonb)"),
                        &params_ref(&[Param::text(c.to_json().to_string())]),
                    )
                    .await
                    .map_err(|e| ApplyFailure::from_pg(Some(&*rel.display), &e))?;
                let v: Option<Value> = row.try_get(0).map_err(|e| fail(rel, e.to_string()))?;
                Ok(match v {
                    None | Some(Value::Null) => Resolution::NoRow,
                    Some(v) => Resolution::Row(v),
                })
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn log_conflict(
        &self,
        rel: &LocalRelation,
        meta: &TxnMeta,
        c: &Conflict,
        key: Option<Value>,
        resolution: &str,
        out: &mut Outcome,
    ) -> Result<(), ApplyFailure> {
        let remote_tuple = c.remote_new.clone().or_else(|| c.remote_old.clone());
        let opt_json = |v: Option<Value>| match v {
            Some(v) => Param::text(v.to_string()),
            None => Param::Null,
        };
        self.exec(
            rel,
            "INSERT INTO mm.conflict_log (relation, conflict_type, key, local_origin, local_commit_ts, \
             remote_origin, remote_commit_ts, remote_lsn, resolution, local_tuple, remote_tuple) \
             VALUES ($1, $2, $3::jsonb, $4, $5::timestamptz, $6, $7::timestamptz, $8::pg_lsn, $9, $10::jsonb, $11::jsonb)",
            &[
                Param::text(rel.display.to_string()),
                Param::text(c.kind.as_str().to_owned()),
                opt_json(key),
                c.local_origin.clone().map_or(Param::Null, Param::text),
                c.local_commit_ts
                    .map_or(Param::Null, |t| Param::text(t.to_rfc3339())),
                Param::text(c.remote_origin.clone()),
                Param::text(meta.commit_ts.to_string()),
                Param::text(meta.commit_lsn.to_string()),
                Param::text(resolution.to_owned()),
                opt_json(c.local.clone()),
                opt_json(remote_tuple),
            ],
        )
        .await?;
        out.conflicts
            .push((c.kind.as_str(), Arc::clone(&rel.display)));
        Ok(())
    }

    fn conflict(
        &self,
        kind: ConflictType,
        rel: &LocalRelation,
        meta: &TxnMeta,
        local: Option<&Version>,
        remote_old: Option<Value>,
        remote_new: Option<Value>,
    ) -> Conflict {
        Conflict {
            kind,
            relation: rel.display.to_string(),
            local: local.and_then(|v| v.row.clone()),
            remote_old,
            remote_new,
            local_origin: local.and_then(|v| self.origin_name(v)),
            local_commit_ts: local.and_then(|v| v.ts),
            remote_origin: self.ctx.peer.clone(),
            remote_commit_ts: remote_ts(meta),
        }
    }

    /// Carries out a row a resolver chose: equal to the incoming or the local
    /// row means exactly that; anything else is written as given.
    fn classify_row(r: Resolution, c: &Conflict) -> Resolution {
        match r {
            Resolution::Row(v) if c.remote_new.as_ref() == Some(&v) => Resolution::ApplyRemote,
            Resolution::Row(v) if c.local.as_ref() == Some(&v) => Resolution::KeepLocal,
            other => other,
        }
    }

    async fn careful_insert(
        &mut self,
        meta: &TxnMeta,
        ins: Insert,
        out: &mut Outcome,
    ) -> Result<(), ApplyFailure> {
        if self
            .discard_if_truncated(
                meta,
                ins.relation_oid,
                ConflictType::InsertExists,
                None,
                Some(&ins.new),
                out,
            )
            .await?
        {
            return Ok(());
        }
        let rel = self.rel(ins.relation_oid)?;
        let params = tuple_params(&ins.new, rel, None)?;
        let key_params: Vec<Param> = rel.key_remote.iter().map(|&i| params[i].clone()).collect();
        let target = match &rel.locator {
            Locator::Key(_) => self.fetch_target(rel, &rel.locator, &key_params).await?,
            Locator::AllColumns(_) => None,
        };
        let collisions = self
            .fetch_collisions(
                rel,
                &ins.new.columns,
                target.as_ref().and_then(|t| t.ctid.as_deref()),
            )
            .await?;
        let cols: Vec<&str> = rel.local_names.iter().map(String::as_str).collect();
        let plain_insert = sql::insert(&rel.table_sql, &cols);
        let (kind, local) = match (&target, collisions.first()) {
            (None, None) => {
                let tomb = self.fetch_tombstone(rel, &key_params).await?;
                match tomb {
                    Some(t) if !self.no_conflict(&t, remote_ts(meta)) => {
                        (ConflictType::InsertExists, Some(t))
                    }
                    other => {
                        let rel = self.rel(ins.relation_oid)?;
                        out.rows += self.exec(rel, &plain_insert, &params).await?;
                        if let Some(t) = other {
                            self.note_routine(&t);
                        }
                        return Ok(());
                    }
                }
            }
            (Some(t), None) => (ConflictType::InsertExists, Some(t.clone())),
            (None, Some(c)) if collisions.len() == 1 => {
                (ConflictType::InsertExists, Some(c.clone()))
            }
            (t, Some(c)) => (
                ConflictType::MultipleUniqueConflicts,
                Some(t.clone().unwrap_or_else(|| c.clone())),
            ),
        };
        let rel = self.rel(ins.relation_oid)?;
        let remote_new = self.tuple_json(rel, &ins.new.columns, |_| true).await?;
        let key = key_of(rel, &remote_new);
        let c = self.conflict(kind, rel, meta, local.as_ref(), None, Some(remote_new));
        let res = Self::classify_row(self.resolve(rel, &c).await?, &c);
        let involved: Vec<&Version> = target.iter().chain(collisions.iter()).collect();
        let label = resolution_label(&res, !involved.is_empty());
        match &res {
            Resolution::ApplyRemote => {
                self.delete_versions(rel, &involved).await?;
                out.rows += self.exec(rel, &plain_insert, &params).await?;
            }
            Resolution::KeepLocal => {}
            Resolution::Row(v) => {
                self.delete_versions(rel, &involved).await?;
                self.write_row(rel, v, None).await?;
            }
            Resolution::NoRow => {
                self.delete_versions(rel, &involved).await?;
                self.write_tombstone(rel, &key_params).await?;
            }
            Resolution::Error(m) => return Err(stop(rel, &c, key.as_ref(), m)),
        }
        self.log_conflict(rel, meta, &c, key, label, out).await
    }

    /// Writes a row a resolver chose: over the local row `over`, or as a
    /// new one.
    async fn write_row(
        &self,
        rel: &LocalRelation,
        row: &Value,
        over: Option<&Version>,
    ) -> Result<(), ApplyFailure> {
        let cols: Vec<&str> = rel.local_names.iter().map(String::as_str).collect();
        match over.and_then(|v| v.ctid.clone()) {
            Some(ctid) => {
                self.exec(
                    rel,
                    &sql::update_json(&rel.table_sql, &rel.settable_names()),
                    &[Param::text(row.to_string()), Param::text(ctid)],
                )
                .await?
            }
            None => {
                self.exec(
                    rel,
                    &sql::insert_json(&rel.table_sql, &cols),
                    &[Param::text(row.to_string())],
                )
                .await?
            }
        };
        Ok(())
    }

    async fn delete_versions(
        &self,
        rel: &LocalRelation,
        vs: &[&Version],
    ) -> Result<(), ApplyFailure> {
        let text = sql::delete_ctid(&rel.table_sql);
        for v in vs {
            if let Some(ctid) = &v.ctid {
                self.exec(rel, &text, &[Param::text(ctid.clone())]).await?;
            }
        }
        Ok(())
    }

    /// The incoming row in full, for a conflicting update that left
    /// TOASTed columns unchanged: their values are the publisher's row's,
    /// which this node may not hold (its own version differs, or the row is
    /// gone here). Read from the publisher by key, and used only if that row
    /// is this change's version or newer (newer changes will arrive after
    /// it and are applied on top).
    pub(super) async fn fetch_unchanged(
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

    async fn careful_update(
        &mut self,
        meta: &TxnMeta,
        mut upd: Update,
        out: &mut Outcome,
    ) -> Result<(), ApplyFailure> {
        let rel = self.rel(upd.relation_oid)?;
        // The row is found by the key (or the old row), which the values
        // completed below never change: located once.
        let (match_mask, loc_params) = locate(rel, upd.old.as_ref(), Some(&upd.new))?;
        let loc = masked_locator(rel, &match_mask);
        let target = self.fetch_target(rel, &loc, &loc_params).await?;
        // A conflicting update with unchanged-TOAST columns: complete it
        // from its origin first, so resolvers see the whole row and the
        // winner is written whole on every node.
        let mut gone_on_origin = false;
        if upd
            .new
            .columns
            .iter()
            .any(|c| matches!(c, ColumnValue::UnchangedToast))
        {
            let conflicting = target
                .as_ref()
                .is_none_or(|t| !self.no_conflict(t, remote_ts(meta)))
                || self.base_may_be_stale(remote_ts(meta));
            if conflicting {
                match self
                    .fetch_unchanged(upd.relation_oid, &upd.new, remote_ts(meta))
                    .await?
                {
                    OriginRow::Fetched(full) => upd.new = full,
                    OriginRow::Gone => gone_on_origin = true,
                    OriginRow::Unavailable(why) => {
                        tracing::debug!(why, "unchanged TOAST values not available from the origin")
                    }
                }
            }
        }
        let rel = self.rel(upd.relation_oid)?;
        let set_mask = rel.set_mask(&upd.new);
        let toast_mask = unchanged_mask(&upd.new);
        let set_params = tuple_params(&upd.new, rel, Some(&set_mask))?;
        let set_cols: Vec<&str> = rel
            .local_names
            .iter()
            .zip(&set_mask)
            .filter(|(_, skip)| !**skip)
            .map(|(n, _)| n.as_str())
            .collect();
        let mut update_params = set_params.clone();
        update_params.extend(loc_params.iter().cloned());
        let plain_update = sql::update(&rel.table_sql, &set_cols, &loc);
        let remote_old = match &upd.old {
            Some(old) => Some(self.old_json(rel, old).await?),
            None => None,
        };
        let remote_new = self.tuple_json(rel, &upd.new.columns, |_| true).await?;
        let key = key_of(rel, remote_old.as_ref().unwrap_or(&remote_new));
        let rts = remote_ts(meta);
        let Some(t) = target else {
            if self
                .discard_if_truncated(
                    meta,
                    upd.relation_oid,
                    ConflictType::UpdateDeleted,
                    upd.old.as_ref(),
                    Some(&upd.new),
                    out,
                )
                .await?
            {
                return Ok(());
            }
            let rel = self.rel(upd.relation_oid)?;
            // The row is gone here: deleted (tombstone) or never arrived.
            // An update that changed the key is, for that key, an insert:
            // what decides is the NEW key's history (its tombstone, rows
            // there now), not the old key's. The old key is gone either
            // way; a newer delete of it must not take the new row along,
            // or the nodes that moved the row first would keep it and the
            // others would not.
            let new_key: Vec<Param> = rel
                .key_remote
                .iter()
                .map(|&i| match upd.new.columns.get(i) {
                    Some(ColumnValue::Text(b)) => Param::Text(b.clone()),
                    _ => Param::Null,
                })
                .collect();
            let key_changed = upd.old.is_some()
                && new_key.iter().zip(&loc_params).any(|(n, o)| match (n, o) {
                    (Param::Text(a), Param::Text(b)) => a != b,
                    _ => true,
                });
            let key_params: Vec<Param> = match &rel.locator {
                Locator::Key(_) if key_changed => new_key,
                Locator::Key(_) => loc_params.clone(),
                Locator::AllColumns(_) => Vec::new(),
            };
            let tomb = self.fetch_tombstone(rel, &key_params).await?;
            let kind = if tomb.is_some() {
                ConflictType::UpdateDeleted
            } else {
                ConflictType::UpdateMissing
            };
            let c = self.conflict(kind, rel, meta, tomb.as_ref(), remote_old, Some(remote_new));
            let res = Self::classify_row(self.resolve(rel, &c).await?, &c);
            match &res {
                Resolution::ApplyRemote => {
                    let unsent: Vec<&str> = rel
                        .local_names
                        .iter()
                        .zip(&toast_mask)
                        .filter(|(_, u)| **u)
                        .map(|(n, _)| n.as_str())
                        .collect();
                    if !unsent.is_empty() && gone_on_origin {
                        // Deleted on its origin since: that delete arrives
                        // after this change and removes the row everywhere;
                        // inserting it now would need values nobody has.
                        tracing::info!(relation = %rel.display, kind = kind.as_str(),
                            "update of a missing row with unchanged TOAST columns: the row is gone on its origin too; not inserting it");
                        return self
                            .log_conflict(rel, meta, &c, key, "keep_local", out)
                            .await;
                    }
                    if !unsent.is_empty() {
                        // MM002: may pass by itself (the row can still
                        // arrive from its origin through a third node), so
                        // wait-sync keeps waiting instead of failing.
                        return Err(ApplyFailure {
                            sqlstate: Some("MM002".to_owned()),
                            ..fail(
                                rel,
                                format!(
                                    "{kind}: key {} is missing here and the update must become an insert, \
                                 but the publisher sent columns {} as unchanged TOAST (values not in the stream); \
                                 NOT writing NULL for them. Unresolved: waiting for the row to arrive from \
                                 another node (retrying), or `mmctl skip` this transaction",
                                    key.as_ref().map_or("?".into(), Value::to_string),
                                    unsent.join(", ")
                                ),
                            )
                        });
                    }
                    // The row it becomes may collide with others (its new
                    // key, or a unique value, taken here meanwhile): a
                    // second decision, as for an insert over them.
                    let collisions = self.fetch_collisions(rel, &upd.new.columns, None).await?;
                    if !collisions.is_empty() {
                        self.log_conflict(rel, meta, &c, key.clone(), "apply_remote", out)
                            .await?;
                        let rel = self.rel(upd.relation_oid)?;
                        let kind = if collisions.len() == 1 {
                            ConflictType::UpdateExists
                        } else {
                            ConflictType::MultipleUniqueConflicts
                        };
                        let remote_new = c.remote_new.clone();
                        let c2 = self.conflict(
                            kind,
                            rel,
                            meta,
                            Some(&collisions[0]),
                            c.remote_old.clone(),
                            remote_new,
                        );
                        let res2 = Self::classify_row(self.resolve(rel, &c2).await?, &c2);
                        let involved: Vec<&Version> = collisions.iter().collect();
                        let label = match &res2 {
                            Resolution::ApplyRemote => {
                                self.delete_versions(rel, &involved).await?;
                                let cols: Vec<&str> =
                                    rel.local_names.iter().map(String::as_str).collect();
                                let params = tuple_params(&upd.new, rel, None)?;
                                out.rows += self
                                    .exec(rel, &sql::insert(&rel.table_sql, &cols), &params)
                                    .await?;
                                "apply_remote"
                            }
                            Resolution::Row(v) => {
                                self.delete_versions(rel, &involved).await?;
                                self.write_row(rel, v, None).await?;
                                "merged"
                            }
                            Resolution::KeepLocal | Resolution::NoRow => "keep_local",
                            Resolution::Error(m) => return Err(stop(rel, &c2, key.as_ref(), m)),
                        };
                        return self.log_conflict(rel, meta, &c2, key, label, out).await;
                    }
                    let rel = self.rel(upd.relation_oid)?;
                    let cols: Vec<&str> = rel.local_names.iter().map(String::as_str).collect();
                    let params = tuple_params(&upd.new, rel, None)?;
                    out.rows += self
                        .exec(rel, &sql::insert(&rel.table_sql, &cols), &params)
                        .await?;
                }
                Resolution::KeepLocal | Resolution::NoRow => {}
                Resolution::Row(v) => {
                    self.write_row(rel, v, None).await?;
                }
                Resolution::Error(m) => return Err(stop(rel, &c, key.as_ref(), m)),
            }
            let label = resolution_label(&res, false);
            return self.log_conflict(rel, meta, &c, key, label, out).await;
        };
        let collisions = self
            .fetch_collisions(rel, &upd.new.columns, t.ctid.as_deref())
            .await?;
        let clean = self.no_conflict(&t, rts);
        if clean && collisions.is_empty() {
            let rel = self.rel(upd.relation_oid)?;
            out.rows += self.exec(rel, &plain_update, &update_params).await?;
            self.note_routine(&t);
            return Ok(());
        }
        let (kind, local) = if !clean {
            (ConflictType::UpdateOriginDiffers, &t)
        } else if collisions.len() == 1 {
            (ConflictType::UpdateExists, &collisions[0])
        } else {
            (ConflictType::MultipleUniqueConflicts, &collisions[0])
        };
        let rel = self.rel(upd.relation_oid)?;
        let c = self.conflict(kind, rel, meta, Some(local), remote_old, Some(remote_new));
        let res = Self::classify_row(self.resolve(rel, &c).await?, &c);
        let mut label = resolution_label(&res, true);
        let others: Vec<&Version> = collisions.iter().collect();
        match &res {
            Resolution::ApplyRemote => {
                self.delete_versions(rel, &others).await?;
                out.rows += self.exec(rel, &plain_update, &update_params).await?;
            }
            // Two rows moved onto one unique value at once: where the
            // incoming change wins, the colliding row gives way (deleted,
            // above); where it loses, the row it moved must go too, or that
            // node would keep a row the other no longer has. Every node then
            // keeps only the winner (docs/ARCHITECTURE.md, conflict table).
            Resolution::KeepLocal if kind != ConflictType::UpdateOriginDiffers => {
                self.delete_versions(rel, &[&t]).await?;
                label = "deleted";
                let shown = key
                    .as_ref()
                    .map_or_else(|| "?".to_owned(), |k| k.to_string());
                tracing::info!(
                    relation = %rel.display,
                    key = %shown,
                    conflict = kind.as_str(),
                    "the incoming update lost on a unique value another row now holds: deleted the row it moved, as every node does"
                );
            }
            Resolution::KeepLocal => {}
            Resolution::Row(v) => {
                self.delete_versions(rel, &others).await?;
                self.write_row(rel, v, Some(&t)).await?;
            }
            Resolution::NoRow => {
                self.delete_versions(rel, &[&t]).await?;
                if matches!(rel.locator, Locator::Key(_)) {
                    self.write_tombstone(rel, &loc_params).await?;
                }
            }
            Resolution::Error(m) => return Err(stop(rel, &c, key.as_ref(), m)),
        }
        self.log_conflict(rel, meta, &c, key, label, out).await
    }

    async fn careful_delete(
        &mut self,
        meta: &TxnMeta,
        del: Delete,
        out: &mut Outcome,
    ) -> Result<(), ApplyFailure> {
        let rel = self.rel(del.relation_oid)?;
        let (match_mask, loc_params) = locate(rel, Some(&del.old), None)?;
        let loc = masked_locator(rel, &match_mask);
        let target = self.fetch_target(rel, &loc, &loc_params).await?;
        let keyed = matches!(rel.locator, Locator::Key(_));
        let rts = remote_ts(meta);
        if let Some(t) = &target
            && self.no_conflict(t, rts)
        {
            let t = t.clone();
            let rel = self.rel(del.relation_oid)?;
            self.delete_versions(rel, &[&t]).await?;
            if keyed {
                self.write_tombstone(rel, &loc_params).await?;
            }
            out.rows += 1;
            self.note_routine(&t);
            return Ok(());
        }
        if target.is_none()
            && self
                .discard_if_truncated(
                    meta,
                    del.relation_oid,
                    ConflictType::DeleteMissing,
                    Some(&del.old),
                    None,
                    out,
                )
                .await?
        {
            return Ok(());
        }
        let rel = self.rel(del.relation_oid)?;
        let remote_old = self.old_json(rel, &del.old).await?;
        let key = key_of(rel, &remote_old);
        let (kind, local) = match &target {
            Some(t) => (ConflictType::DeleteOriginDiffers, Some(t.clone())),
            None => {
                let tomb = if keyed {
                    self.fetch_tombstone(rel, &loc_params).await?
                } else {
                    None
                };
                (ConflictType::DeleteMissing, tomb)
            }
        };
        let c = self.conflict(kind, rel, meta, local.as_ref(), Some(remote_old), None);
        let res = Self::classify_row(self.resolve(rel, &c).await?, &c);
        let label = resolution_label(&res, target.is_some());
        match &res {
            Resolution::ApplyRemote | Resolution::NoRow => {
                if let Some(t) = &target {
                    self.delete_versions(rel, &[t]).await?;
                    out.rows += 1;
                }
                if keyed {
                    self.write_tombstone(rel, &loc_params).await?;
                }
            }
            Resolution::KeepLocal => {}
            Resolution::Row(v) => {
                self.write_row(rel, v, target.as_ref()).await?;
            }
            Resolution::Error(m) => return Err(stop(rel, &c, key.as_ref(), m)),
        }
        self.log_conflict(rel, meta, &c, key, label, out).await
    }
}

fn remote_ts(meta: &TxnMeta) -> DateTime<Utc> {
    meta.commit_ts
        .to_datetime()
        .unwrap_or(DateTime::<Utc>::MIN_UTC)
}

/// The key columns of a row's jsonb, for the conflict log.
fn key_of(rel: &LocalRelation, row: &Value) -> Option<Value> {
    let names = rel.key_names()?;
    let mut m = serde_json::Map::new();
    for n in names {
        m.insert(n.to_owned(), row.get(n).cloned().unwrap_or(Value::Null));
    }
    Some(Value::Object(m))
}

/// What the publisher holds for a row whose unchanged-TOAST values a
/// conflict needs.
pub(super) enum OriginRow {
    /// The incoming tuple with those values filled in.
    Fetched(TupleData),
    /// No row at that key any more.
    Gone,
    /// Cannot be used (no key, or an older version): the stream retries.
    Unavailable(String),
}

/// The `error` resolver (or a resolver's error): the stream stops here.
fn stop(rel: &LocalRelation, c: &Conflict, key: Option<&Value>, msg: &str) -> ApplyFailure {
    fail(
        rel,
        format!(
            "unresolved conflict {} on key {} (local version from {} at {}, incoming from {} at {}): {msg}",
            c.kind,
            key.map_or("?".into(), Value::to_string),
            c.local_origin.as_deref().unwrap_or("-"),
            c.local_commit_ts.map_or("-".into(), |t| t.to_rfc3339()),
            c.remote_origin,
            c.remote_commit_ts.to_rfc3339(),
        ),
    )
}
