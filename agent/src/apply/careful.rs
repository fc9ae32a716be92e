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
use tokio_postgres::Statement;
use tokio_postgres::types::ToSql;

use super::pipeline::Done;
use super::relation::LocalRelation;
use super::sql::{self, Locator};
use super::tuple::{column_count, locate, masked_locator, tuple_params, unchanged_mask};
use super::txn::{TxnBody, TxnMeta};
use super::{Applier, ApplyFailure, Param};
use crate::conflict::classify::{self, Detection, Facts, Local, Op, Plan, Seen, Write};
use crate::conflict::{Conflict, ConflictType, Resolution, ResolverChoice};

/// A local row (or a tombstone) and its version.
#[derive(Debug, Clone)]
pub(super) struct Version {
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
pub(super) struct Outcome {
    rows: u64,
    conflicts: Vec<(&'static str, Arc<str>)>,
    /// Conflict-log rows (relation, params of `CONFLICT_LOG_INSERT`), sent
    /// with the progress record and COMMIT in one pipelined round: nothing
    /// waits for their replies. At most `HELD` of them (`flush_held`).
    log_rows: Vec<(Arc<str>, Vec<Param>)>,
}

/// Conflict-log rows and unread replies of deferred writes a careful
/// transaction holds at most: each log row holds both tuples as JSON, each
/// unread reply its statement's future, and a large transaction in
/// conflict on every row held them all until its COMMIT (60k rows: ~210
/// MiB of agent memory). One round trip per this many.
const HELD: usize = 256;

/// One statement of the careful transaction's last pipelined round.
type RoundStatement<'a> =
    std::pin::Pin<Box<dyn Future<Output = Result<u64, ApplyFailure>> + Send + 'a>>;

const CONFLICT_LOG_INSERT: &str = "INSERT INTO mm.conflict_log (relation, conflict_type, key, local_origin, local_commit_ts, \
     remote_origin, remote_commit_ts, remote_lsn, resolution, local_tuple, remote_tuple) \
     VALUES ($1, $2, $3::jsonb, $4, $5::timestamptz, $6, $7::timestamptz, $8::pg_lsn, $9, $10::jsonb, $11::jsonb)";

/// How often a careful transaction is judged again after losing a race with
/// another stream (see `apply_careful`) before the stream stops.
const CONCURRENT_RETRIES: u32 = 8;

/// Messages of a conflicting transaction whose keys are remembered as hot.
const HOT_KEYS_PER_TXN: usize = 64;

/// Careful-path statements kept prepared per session (`Applier::prepared`).
const CAREFUL_STMTS: usize = 512;

/// A failure caused by another session writing at the same moment: a unique
/// value taken after it was judged free, a deadlock, a serialization failure.
fn is_concurrent_apply(f: &ApplyFailure) -> bool {
    matches!(f.sqlstate.as_deref(), Some("23505" | "40P01" | "40001"))
}

fn fail(rel: &LocalRelation, msg: impl Into<String>) -> ApplyFailure {
    ApplyFailure::new(Some(&*rel.display), msg)
}

fn params_ref(p: &[Param]) -> Vec<&(dyn ToSql + Sync)> {
    p.iter().map(|v| v as &(dyn ToSql + Sync)).collect()
}

impl Applier {
    /// Applies one transaction with conflict resolution and commits it.
    ///
    /// Streams from different peers apply concurrently, each in its own
    /// session. Two of them may judge the same new key (or unique value)
    /// free at once: the later insert then waits on the earlier one's index
    /// entry and fails with 23505 when it commits, or the two deadlock
    /// (40P01). Neither is a property of the change: the transaction is
    /// rolled back and judged again, now seeing the other stream's row (a
    /// conflict the resolver decides like any other). Stopping the stream
    /// there would leave it stuck on a state that no longer exists.
    /// `rolled_back`: its fast-path attempt met a conflict (status counts it).
    pub(super) async fn apply_careful(
        &mut self,
        meta: &TxnMeta,
        body: &TxnBody,
        rolled_back: bool,
    ) -> Result<(), ApplyFailure> {
        let mut attempt = 0u32;
        loop {
            let routine = self.routine_careful_count();
            match self.apply_careful_once(meta, body, rolled_back).await {
                Err(f) if attempt < CONCURRENT_RETRIES && is_concurrent_apply(&f) => {
                    attempt += 1;
                    self.set_routine_careful_count(routine);
                    tracing::debug!(xid = meta.xid, commit_lsn = %meta.commit_lsn, attempt,
                        sqlstate = ?f.sqlstate, error = %f.message,
                        "another stream wrote the same row meanwhile: judging the transaction again");
                    tokio::time::sleep(std::time::Duration::from_millis(5 << attempt.min(6))).await;
                }
                r => return r,
            }
        }
    }

    async fn apply_careful_once(
        &mut self,
        meta: &TxnMeta,
        body: &TxnBody,
        rolled_back: bool,
    ) -> Result<(), ApplyFailure> {
        let pg = |e: tokio_postgres::Error| ApplyFailure::from_pg(None, &e);
        let mut src = body.open()?;
        // Invariant (`gate.rs`): no fast-path transaction of any stream is
        // in flight from here to COMMIT; this stream's own were drained by
        // `recover`, so it does not wait for itself.
        let _gate = self.ctx.gate.exclusive().await;
        // Invariant (one careful transaction at a time per node): streams
        // from different peers apply in parallel sessions, and a careful
        // transaction decides from what it reads (target, tombstone, rows
        // holding its unique values). Two of them on one key at once would
        // each read the other's state from before it committed (a delete's
        // tombstone not yet visible to a concurrent update of that key, which
        // then brings the row back on this node only). Taken before the
        // first read, held until COMMIT. Within one agent the gate above
        // already does this; the lock says it to PostgreSQL too (any other
        // session applying on this node's behalf, and what pg_locks shows).
        // BEGIN and the lock go out with the first read, not a round trip
        // ahead of it: the careful path runs one transaction at a time, so
        // its round trips are its cost (`deferred.rs`).
        self.deferred.clear();
        // Invariant (origin, `pipeline.rs`): this session writes under the
        // stream's origin only once the pipelined session let go of it.
        if let Some(p) = self.pipe.as_mut() {
            p.give_origin().await?;
        }
        let lock = self.prepared(sql::CAREFUL_LOCK).await.map_err(pg)?;
        self.deferred
            .send_begin(&self.client, &[&self.begin.on_client()?.clone(), &lock]);
        let mut out = Outcome::default();
        // Set when the COMMIT below is sent: it ends the transaction either
        // way, and a ROLLBACK after it only makes PostgreSQL warn.
        let commit_sent = std::sync::atomic::AtomicBool::new(false);
        let r = async {
            let mut fk_checks = Vec::new();
            while let Some(msg) = src.next_message()? {
                if let Message::Insert(Insert { relation_oid, .. })
                | Message::Update(Update { relation_oid, .. })
                | Message::Delete(Delete { relation_oid, .. }) = &msg
                {
                    fk_checks.extend(super::fk::checks_for(self.rel(*relation_oid)?, &msg));
                }
                if out.log_rows.len() >= HELD || self.deferred.pending() >= HELD {
                    self.flush_held(&mut out).await?;
                }
                match msg {
                    Message::Relation(r) => self.load_relation(r).await?,
                    Message::Insert(i) => self.careful_insert(meta, i, &mut out).await?,
                    Message::Update(u) => self.careful_update(meta, u, &mut out).await?,
                    Message::Delete(d) => self.careful_delete(meta, d, &mut out).await?,
                    Message::Truncate(t) => {
                        self.deferred.begun().await?;
                        let (_, params) = self.truncate_params(meta, &t)?;
                        let stmt = self.prepared(sql::APPLY_TRUNCATE).await.map_err(pg)?;
                        self.client
                            .execute(&stmt, &params_ref(&params))
                            .await
                            .map_err(pg)?;
                    }
                    Message::Message(m) if super::compensation::is_compensation(&m) => {
                        self.careful_compensation(meta, &m, &mut out).await?
                    }
                    Message::Message(m) if super::applier::is_partition_truncate(&m) => {
                        self.deferred.begun().await?;
                        let params = super::applier::partition_truncate_params(&m, meta);
                        let stmt = self
                            .prepared(sql::APPLY_PARTITION_TRUNCATE)
                            .await
                            .map_err(pg)?;
                        self.client
                            .execute(&stmt, &params_ref(&params))
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
            // Nothing below may run outside the transaction.
            self.deferred.begun().await?;
            for check in fk_checks {
                let (text, child) = self.fk_sql(&check)?;
                let stmt = self.prepared(&text).await.map_err(pg)?;
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
            let (advance, commit) = (
                self.advance.on_client()?.clone(),
                self.commit.on_client()?.clone(),
            );
            let log = self.prepared(CONFLICT_LOG_INSERT).await.map_err(pg)?;
            let progress = self.progress_params(meta);
            let log_rows = std::mem::take(&mut out.log_rows);
            // One pipelined round: the log rows, the progress record and
            // COMMIT are sent in this order (each query is sent at its first
            // poll, and `try_join_all` polls in order) and none needs an
            // earlier one's reply. A failure among them aborts the
            // transaction, which the COMMIT then rolls back.
            // The deferred writes' replies first: a failure among them is the
            // one to report (the statements after it fail with 25P02).
            let mut round: Vec<RoundStatement<'_>> = Vec::with_capacity(log_rows.len() + 3);
            let deferred = &self.deferred;
            round.push(Box::pin(async move { deferred.settle().await.map(|()| 0) }));
            for (rel, params) in &log_rows {
                let (client, log) = (&self.client, &log);
                round.push(Box::pin(async move {
                    client
                        .execute(log, &params_ref(params))
                        .await
                        .map_err(|e| ApplyFailure::from_pg(Some(rel), &e))
                }));
            }
            let client = &self.client;
            round.push(Box::pin(async {
                client
                    .execute(&advance, &params_ref(&progress))
                    .await
                    .map_err(pg)
            }));
            let sent = &commit_sent;
            round.push(Box::pin(async move {
                // The query goes out at this first poll.
                sent.store(true, std::sync::atomic::Ordering::Relaxed);
                client.execute(&commit, &[]).await.map_err(pg)
            }));
            futures_util::future::try_join_all(round).await?;
            Ok(())
        }
        .await;
        if let Err(mut f) = r {
            // A deferred write that failed made what followed it fail with
            // 25P02: its own error is the one to report.
            if let Err(first) = self.deferred.settle().await {
                f = first;
            }
            self.deferred.clear();
            // BEGIN went through: end the aborted transaction here, unless
            // the COMMIT was sent (it ended it either way).
            if !commit_sent.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = self.client.batch_execute("ROLLBACK").await;
            }
            f.txn = Some(*meta);
            f.conflict = false;
            return Err(f);
        }
        out.rows += self.deferred.take_rows();
        // Right after a conflict more are likely: the stream applies its
        // next transactions one at a time, and those on this key carefully
        // from the start (`hot.rs`).
        if !out.conflicts.is_empty() {
            self.note_hot_keys(body);
            self.streak = self.streak.max(super::recover::CONFLICT_STREAK);
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
            rolled_back,
            in_place: 0,
        });
        Ok(())
    }

    /// Writes the conflict-log rows held so far, inside the transaction,
    /// and reads every deferred write's reply (their futures and params
    /// are dropped only then); the first failure among them, as at COMMIT.
    async fn flush_held(&self, out: &mut Outcome) -> Result<(), ApplyFailure> {
        if !out.log_rows.is_empty() {
            let log = self
                .prepared(CONFLICT_LOG_INSERT)
                .await
                .map_err(|e| ApplyFailure::from_pg(None, &e))?;
            for (rel, params) in out.log_rows.drain(..) {
                self.deferred
                    .send(&self.client, &log, params, Some(rel), false);
            }
        }
        self.deferred.settle().await
    }

    /// Remembers the keys of a transaction that met a conflict (its first
    /// changes only: the set steers single-change transactions).
    fn note_hot_keys(&mut self, body: &TxnBody) {
        let Ok(mut src) = body.open() else {
            return;
        };
        for _ in 0..HOT_KEYS_PER_TXN {
            let Ok(Some(msg)) = src.next_message() else {
                break;
            };
            let Some(oid) = super::hot::relation_of(&msg) else {
                continue;
            };
            if let Some(k) = self
                .relations
                .get(&oid)
                .and_then(|rel| super::hot::key_of(rel, &msg))
            {
                self.hot.insert(k);
            }
        }
    }

    /// A careful-path statement, prepared once per session. Sent as text,
    /// each would cost a Parse/Describe round trip and a plan; the careful
    /// path applies one transaction at a time, so its round trips are its
    /// cost (hot keys: nearly every transaction conflicts). Texts are per
    /// relation and column shape, so the cache stays small; it is bounded
    /// anyway.
    pub(super) async fn prepared(&self, text: &str) -> Result<Statement, tokio_postgres::Error> {
        let cached = self
            .careful_stmts
            .lock()
            .ok()
            .and_then(|m| m.get(text).cloned());
        if let Some(s) = cached {
            return Ok(s);
        }
        let s = self.client.prepare(text).await?;
        if let Ok(mut m) = self.careful_stmts.lock() {
            if m.len() >= CAREFUL_STMTS {
                m.clear();
            }
            m.insert(text.to_owned(), s.clone());
        }
        Ok(s)
    }

    async fn query_versions(
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
    pub(super) async fn fetch_target(
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

    async fn write_tombstone(
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
    async fn exec(
        &self,
        rel: &LocalRelation,
        text: &str,
        params: &[Param],
    ) -> Result<(), ApplyFailure> {
        self.send_write(rel, text, params, false).await
    }

    /// `exec` of the change itself: its rows count as rows applied.
    async fn exec_row(
        &self,
        rel: &LocalRelation,
        text: &str,
        params: &[Param],
    ) -> Result<(), ApplyFailure> {
        self.send_write(rel, text, params, true).await
    }

    async fn send_write(
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
    pub(super) async fn tuple_json(
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
    /// applies on the fast path). `margin`: take the peer's watermark less
    /// `watermark::ORDER_MARGIN`, when values are kept from the local row
    /// (`applier::Guard::params` says why).
    fn no_conflict(&self, v: &Version, remote_ts: DateTime<Utc>, margin: bool) -> bool {
        let facts = crate::conflict::routine::VersionFacts {
            roident: v.roident,
            ts: v.ts,
            this_txn: v.this_txn,
        };
        crate::conflict::routine::no_resolver_needed(
            &facts,
            &self.peer_roidents,
            |id| {
                let node = self.origins.get(&id)?;
                let w = self.wm.map.get(node).copied()?;
                Some(if margin {
                    w - crate::watermark::ORDER_MARGIN
                } else {
                    w
                })
            },
            remote_ts,
        )
    }

    /// Counts a no-conflict change to another origin's version as routine.
    fn note_routine(&mut self, v: &Version) {
        if !v.this_txn && !v.roident.is_some_and(|r| self.peer_roidents.contains(&r)) {
            self.count_routine();
        }
    }

    /// Asks the table's resolver.
    async fn resolve(&self, rel: &LocalRelation, c: &Conflict) -> Result<Resolution, ApplyFailure> {
        match self.ctx.resolvers.for_table(&rel.display) {
            ResolverChoice::Rust(r) => Ok(r.resolve(c)),
            ResolverChoice::Sql { function } => {
                let pg = |e: tokio_postgres::Error| ApplyFailure::from_pg(Some(&*rel.display), &e);
                let stmt = self
                    .prepared(&format!("SELECT {function}($1::jsonb)"))
                    .await
                    .map_err(pg)?;
                let row = self
                    .client
                    .query_one(&stmt, &params_ref(&[Param::text(c.to_json().to_string())]))
                    .await
                    .map_err(pg)?;
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
        out.log_rows.push((
            Arc::clone(&rel.display),
            vec![
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
        ));
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

    /// A local version as the rules see it.
    fn seen(&self, v: &Version, rts: DateTime<Utc>) -> Seen {
        Seen {
            routine: self.no_conflict(v, rts, false),
            ts: v.ts,
            origin: self.origin_name(v),
        }
    }

    /// The rules' facts from what was found.
    fn facts(&self, op: Op, found: &Found, rts: DateTime<Utc>) -> Facts {
        Facts {
            op,
            target: found.target.as_ref().map(|v| self.seen(v, rts)),
            tombstone: found.tombstone.as_ref().map(|v| self.seen(v, rts)),
            collisions: found.collisions.iter().map(|v| self.seen(v, rts)).collect(),
            truncated: found
                .truncate
                .as_ref()
                .is_some_and(|t| !t.this_txn && t.ts.is_some_and(|ts| rts <= ts)),
            target_beaten: false,
        }
    }

    /// The table's truncate version when nothing is at the key (a row there
    /// is newer than any truncate that left it).
    async fn truncate_if_gone(
        &self,
        rel: &LocalRelation,
        target: &Option<Version>,
    ) -> Result<Option<Version>, ApplyFailure> {
        match target {
            Some(_) => Ok(None),
            None => self.fetch_truncate(rel).await,
        }
    }

    /// Detects, asks the resolver and plans, in one or two decisions (the
    /// change's own key first, then the rows holding its unique values:
    /// `Plan::next`). One conflict comes out for both: the first decision's
    /// type, the second's versions and outcome.
    async fn judge(
        &self,
        rel: &LocalRelation,
        meta: &TxnMeta,
        mut facts: Facts,
        found: &Found,
        remote_old: &Option<Value>,
        remote_new: &Option<Value>,
    ) -> Result<Judgement, ApplyFailure> {
        let mut first_kind = None;
        loop {
            let (kind, local) = match classify::detect(&facts) {
                Detection::Apply => return Ok(Judgement::Apply),
                Detection::Truncated(kind) => return Ok(Judgement::Truncated(kind)),
                Detection::Conflict { kind, local } => (kind, local),
            };
            let c = self.conflict(
                first_kind.unwrap_or(kind),
                rel,
                meta,
                found.version(local),
                remote_old.clone(),
                remote_new.clone(),
            );
            let res = Self::classify_row(self.resolve(rel, &c).await?, &c);
            let plan = classify::plan(&facts, local, &res);
            tracing::debug!(relation = %rel.display,
                key = ?remote_new.as_ref().or(remote_old.as_ref()).and_then(|v| key_of(rel, v)),
                op = ?facts.op,
                target = ?facts.target, tombstone = ?facts.tombstone,
                collisions = ?facts.collisions, judged_against = ?local,
                resolution = plan.label, "conflict judged");
            if plan.next {
                first_kind.get_or_insert(kind);
                facts.target_beaten = true;
                continue;
            }
            return Ok(Judgement::Decided(Box::new((c, plan))));
        }
    }

    /// Carries a plan out (except `write: Change` / `AsInsert`, which the
    /// caller does: only it has the statement) and records the compensating
    /// deletes it asks for.
    #[allow(clippy::too_many_arguments)]
    async fn carry_out(
        &self,
        rel: &LocalRelation,
        meta: &TxnMeta,
        plan: &Plan,
        found: &Found,
        key_params: &[Param],
        incoming: Option<&Value>,
        c: &Conflict,
    ) -> Result<(), ApplyFailure> {
        if let Some(m) = &plan.error {
            return Err(stop(
                rel,
                c,
                incoming.and_then(|v| key_of(rel, v)).as_ref(),
                m,
            ));
        }
        if plan.delete_collisions {
            let vs: Vec<&Version> = found.collisions.iter().collect();
            self.delete_versions(rel, &vs).await?;
        }
        if plan.delete_target
            && let Some(t) = &found.target
        {
            self.delete_versions(rel, &[t]).await?;
        }
        if let Write::Row(v) = &plan.write {
            let over = found.target.as_ref().filter(|_| !plan.delete_target);
            self.write_row(rel, v, over).await?;
        }
        if plan.tombstone && matches!(rel.locator, Locator::Key(_)) {
            self.write_tombstone(rel, key_params).await?;
        }
        // Newer than every version involved, on this node's clock.
        let mut not_before = remote_ts(meta);
        for v in found
            .target
            .iter()
            .chain(&found.collisions)
            .filter_map(|v| v.ts)
        {
            not_before = not_before.max(v);
        }
        let mut keys: Vec<Value> = Vec::new();
        if plan.compensate.incoming {
            keys.extend(incoming.and_then(|v| key_of(rel, v)));
        }
        if plan.compensate.target {
            keys.extend(
                found
                    .target
                    .as_ref()
                    .and_then(|t| t.row.as_ref())
                    .and_then(|r| key_of(rel, r)),
            );
        }
        if plan.compensate.collisions {
            keys.extend(
                found
                    .collisions
                    .iter()
                    .filter_map(|v| v.row.as_ref())
                    .filter_map(|r| key_of(rel, r)),
            );
        }
        for key in keys {
            tracing::info!(relation = %rel.display, key = %key,
                "a row gave way on a unique value to a row at another key: its delete is sent to every node after this transaction commits");
            self.exec(
                rel,
                "INSERT INTO mm.compensations (relid, key, not_before) VALUES ($1::oid, $2::jsonb, $3::timestamptz)",
                &[
                    Param::text(rel.relid.to_string()),
                    Param::text(key.to_string()),
                    Param::text(not_before.to_rfc3339()),
                ],
            )
            .await?;
        }
        Ok(())
    }

    async fn careful_insert(
        &mut self,
        meta: &TxnMeta,
        ins: Insert,
        out: &mut Outcome,
    ) -> Result<(), ApplyFailure> {
        self.careful_put(
            meta,
            ins.relation_oid,
            Op::Insert,
            &ins.new,
            None,
            false,
            out,
        )
        .await
    }

    /// A new row at its key: an insert, the new key of a key change
    /// (`Op::MovedIn`), or an update of a missing row that won
    /// (`tombstone_beaten`). `new` is complete (no unchanged TOAST).
    #[allow(clippy::too_many_arguments)]
    async fn careful_put(
        &mut self,
        meta: &TxnMeta,
        oid: u32,
        op: Op,
        new: &TupleData,
        remote_old: Option<Value>,
        tombstone_beaten: bool,
        out: &mut Outcome,
    ) -> Result<(), ApplyFailure> {
        let rts = remote_ts(meta);
        let rel = self.rel(oid)?;
        let params = tuple_params(new, rel, None)?;
        let key_params: Vec<Param> = rel.key_remote.iter().map(|&i| params[i].clone()).collect();
        let target = match &rel.locator {
            Locator::Key(_) => self.fetch_target(rel, &rel.locator, &key_params).await?,
            Locator::AllColumns(_) => None,
        };
        let collisions = self
            .fetch_collisions(
                rel,
                &new.columns,
                target.as_ref().and_then(|t| t.ctid.as_deref()),
            )
            .await?;
        let tombstone = match (&target, tombstone_beaten) {
            (None, false) => self.fetch_tombstone(rel, &key_params).await?,
            _ => None,
        };
        let truncate = self.truncate_if_gone(rel, &target).await?;
        let found = Found {
            target,
            tombstone,
            collisions,
            truncate,
        };
        let facts = self.facts(op, &found, rts);
        let remote_new = Some(self.tuple_json(rel, &new.columns, |_| true).await?);
        let key = remote_new.as_ref().and_then(|v| key_of(rel, v));
        let cols: Vec<&str> = rel.local_names.iter().map(String::as_str).collect();
        let plain_insert = sql::insert(&rel.table_sql, &cols);
        let (c, plan) = match self
            .judge(rel, meta, facts, &found, &remote_old, &remote_new)
            .await?
        {
            Judgement::Apply => {
                self.exec_row(rel, &plain_insert, &params).await?;
                if let Some(t) = &found.tombstone {
                    self.note_routine(t);
                }
                return Ok(());
            }
            Judgement::Truncated(kind) => {
                return self
                    .log_truncated(oid, meta, kind, &found, remote_old, remote_new, out)
                    .await;
            }
            Judgement::Decided(d) => *d,
        };
        let rel = self.rel(oid)?;
        self.carry_out(
            rel,
            meta,
            &plan,
            &found,
            &key_params,
            remote_new.as_ref(),
            &c,
        )
        .await?;
        if plan.write == Write::Change {
            // Over an existing row: carry_out deleted it (delete_target).
            self.exec_row(rel, &plain_insert, &params).await?;
        }
        self.log_conflict(rel, meta, &c, key, plan.label, out).await
    }

    /// Logs a change discarded for being older than its table's truncate.
    #[allow(clippy::too_many_arguments)]
    async fn log_truncated(
        &mut self,
        oid: u32,
        meta: &TxnMeta,
        kind: ConflictType,
        found: &Found,
        remote_old: Option<Value>,
        remote_new: Option<Value>,
        out: &mut Outcome,
    ) -> Result<(), ApplyFailure> {
        let rel = self.rel(oid)?;
        let key = remote_old
            .as_ref()
            .or(remote_new.as_ref())
            .and_then(|v| key_of(rel, v));
        let c = self.conflict(
            kind,
            rel,
            meta,
            found.truncate.as_ref(),
            remote_old,
            remote_new,
        );
        self.log_conflict(rel, meta, &c, key, "keep_local", out)
            .await
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

    /// Unchanged-TOAST columns of `new` filled with the local row's values
    /// (the row at `at`, `tableoid:ctid`): right when that row is the
    /// version the publisher changed (no conflict with it).
    async fn complete_from_local(
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
    fn toast_unavailable(
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

    async fn careful_update(
        &mut self,
        meta: &TxnMeta,
        mut upd: Update,
        out: &mut Outcome,
    ) -> Result<(), ApplyFailure> {
        let oid = upd.relation_oid;
        let rts = remote_ts(meta);
        let rel = self.rel(oid)?;
        let (match_mask, loc_params) = locate(rel, upd.old.as_ref(), Some(&upd.new))?;
        if key_changed(rel, &upd, &loc_params) {
            return self.careful_move(meta, upd, loc_params, out).await;
        }
        let loc = masked_locator(rel, &match_mask);
        let toast = upd
            .new
            .columns
            .iter()
            .any(|c| matches!(c, ColumnValue::UnchangedToast));
        // Two reads that do not depend on each other, in one round trip: the
        // target and the incoming row as the conflict log and resolvers see
        // it (unless it is to be completed from its origin first).
        let (target, new_json) = if toast {
            (self.fetch_target(rel, &loc, &loc_params).await?, None)
        } else {
            let (t, n) = futures_util::try_join!(
                self.fetch_target(rel, &loc, &loc_params),
                self.tuple_json(rel, &upd.new.columns, |_| true)
            )?;
            (t, Some(n))
        };
        // A conflicting update with unchanged-TOAST columns: complete it
        // from its origin first, so resolvers see the whole row and the
        // winner is written whole on every node.
        let mut gone_on_origin = false;
        if toast {
            let conflicting = target
                .as_ref()
                .is_none_or(|t| !self.no_conflict(t, rts, true))
                || self.base_may_be_stale(rts);
            if conflicting {
                match self.fetch_unchanged(oid, &upd.new, rts).await? {
                    OriginRow::Fetched(full) => upd.new = full,
                    OriginRow::Gone => gone_on_origin = true,
                    OriginRow::Unavailable(why) => {
                        tracing::debug!(why, "unchanged TOAST values not available from the origin")
                    }
                }
            }
        }
        let rel = self.rel(oid)?;
        let set_mask = rel.set_mask(&upd.new);
        let mut update_params = tuple_params(&upd.new, rel, Some(&set_mask))?;
        update_params.extend(loc_params.iter().cloned());
        let set_cols: Vec<&str> = rel
            .local_names
            .iter()
            .zip(&set_mask)
            .filter(|(_, skip)| !**skip)
            .map(|(n, _)| n.as_str())
            .collect();
        let plain_update = sql::update(&rel.table_sql, &set_cols, &loc);
        let remote_old = match &upd.old {
            Some(old) => Some(self.old_json(rel, old).await?),
            None => None,
        };
        let remote_new = match new_json {
            Some(v) => v,
            None => self.tuple_json(rel, &upd.new.columns, |_| true).await?,
        };
        let key = key_of(rel, remote_old.as_ref().unwrap_or(&remote_new));
        let collisions = match &target {
            Some(t) => {
                self.fetch_collisions(rel, &upd.new.columns, t.ctid.as_deref())
                    .await?
            }
            None => Vec::new(),
        };
        let tombstone = match (&target, &rel.locator) {
            (None, Locator::Key(_)) => self.fetch_tombstone(rel, &loc_params).await?,
            _ => None,
        };
        let truncate = self.truncate_if_gone(rel, &target).await?;
        let found = Found {
            target,
            tombstone,
            collisions,
            truncate,
        };
        let facts = self.facts(Op::Update, &found, rts);
        let remote_new = Some(remote_new);
        let (c, plan) = match self
            .judge(rel, meta, facts, &found, &remote_old, &remote_new)
            .await?
        {
            Judgement::Apply => {
                self.exec_row(rel, &plain_update, &update_params).await?;
                if let Some(t) = &found.target {
                    self.note_routine(t);
                }
                return Ok(());
            }
            Judgement::Truncated(kind) => {
                return self
                    .log_truncated(oid, meta, kind, &found, remote_old, remote_new, out)
                    .await;
            }
            Judgement::Decided(d) => *d,
        };
        let rel = self.rel(oid)?;
        let kind = c.kind;
        if plan.write == Write::AsInsert {
            // The row is gone here and the update wins: it becomes an
            // insert of its new row, which needs every column.
            if unchanged_mask(&upd.new).iter().any(|u| *u) {
                if gone_on_origin {
                    // Deleted on its origin since: that delete arrives
                    // after this change and removes the row everywhere;
                    // inserting it now would need values nobody has.
                    tracing::info!(relation = %rel.display, kind = kind.as_str(),
                        "update of a missing row with unchanged TOAST columns: the row is gone on its origin too; not inserting it");
                    return self
                        .log_conflict(rel, meta, &c, key, "keep_local", out)
                        .await;
                }
                return Err(Self::toast_unavailable(
                    rel,
                    kind.as_str(),
                    key.as_ref(),
                    &upd.new,
                ));
            }
            self.log_conflict(rel, meta, &c, key, plan.label, out)
                .await?;
            return self
                .careful_put(meta, oid, Op::MovedIn, &upd.new, remote_old, true, out)
                .await;
        }
        self.carry_out(
            rel,
            meta,
            &plan,
            &found,
            &loc_params,
            remote_new.as_ref(),
            &c,
        )
        .await?;
        if plan.write == Write::Change {
            self.exec_row(rel, &plain_update, &update_params).await?;
        }
        self.log_conflict(rel, meta, &c, key, plan.label, out).await
    }

    /// An update that changed the key: a delete of the old key and an
    /// insert at the new one, each judged on its own key, so every node
    /// ends with the same versions at both whatever else happened to them
    /// (a node that applied a newer change to the old row keeps it, and
    /// still gets the new one).
    async fn careful_move(
        &mut self,
        meta: &TxnMeta,
        upd: Update,
        old_key: Vec<Param>,
        out: &mut Outcome,
    ) -> Result<(), ApplyFailure> {
        let oid = upd.relation_oid;
        let rts = remote_ts(meta);
        let rel = self.rel(oid)?;
        let target = self.fetch_target(rel, &rel.locator, &old_key).await?;
        let remote_old = match &upd.old {
            Some(old) => self.old_json(rel, old).await?,
            None => Value::Null,
        };
        // The new row whole: from the moved row if it is the version the
        // publisher changed, else from the publisher.
        let mut new = Some(upd.new.clone());
        if unchanged_mask(&upd.new).iter().any(|u| *u) {
            let local = target
                .as_ref()
                .filter(|t| self.no_conflict(t, rts, true) && !self.base_may_be_stale(rts))
                .and_then(|t| t.ctid.clone());
            tracing::debug!(relation = %rel.display, old_key = ?old_key,
                target = ?target.as_ref().map(|t| self.seen(t, rts)),
                stale = self.base_may_be_stale(rts), from_local = local.is_some(),
                "a moved row's unchanged TOAST values");
            new = match local {
                Some(at) => Some(self.complete_from_local(rel, &upd.new, &at).await?),
                None => match self.fetch_unchanged(oid, &upd.new, rts).await? {
                    OriginRow::Fetched(full) => Some(full),
                    // Changed again on its origin since: that change follows.
                    OriginRow::Gone => None,
                    OriginRow::Unavailable(why) => {
                        let rel = self.rel(oid)?;
                        let remote_new = self.tuple_json(rel, &upd.new.columns, |_| true).await?;
                        tracing::debug!(why, "unchanged TOAST values of a moved row not available");
                        return Err(Self::toast_unavailable(
                            rel,
                            "update_exists",
                            key_of(rel, &remote_new).as_ref(),
                            &upd.new,
                        ));
                    }
                },
            };
        }
        let rel = self.rel(oid)?;
        let remote_new = self.tuple_json(rel, &upd.new.columns, |_| true).await?;
        let wrote_row = self
            .careful_remove(
                meta,
                oid,
                Op::MovedOut,
                target,
                old_key,
                remote_old.clone(),
                Some(remote_new),
                false,
                out,
            )
            .await?;
        match new {
            Some(new) if !wrote_row => {
                self.careful_put(meta, oid, Op::MovedIn, &new, Some(remote_old), false, out)
                    .await
            }
            _ => Ok(()),
        }
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
        let remote_old = self.old_json(rel, &del.old).await?;
        self.careful_remove(
            meta,
            del.relation_oid,
            Op::Delete,
            target,
            loc_params,
            remote_old,
            None,
            false,
            out,
        )
        .await
        .map(|_| ())
    }

    /// A key going away: a delete, the old key of a key change
    /// (`Op::MovedOut`), or a compensating delete from a peer. `target` is
    /// the locked row found at it. True when a resolver's row was written
    /// in its place (a key change then writes nothing at its new key).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn careful_remove(
        &mut self,
        meta: &TxnMeta,
        oid: u32,
        op: Op,
        target: Option<Version>,
        loc_params: Vec<Param>,
        remote_old: Value,
        remote_new: Option<Value>,
        compensating: bool,
        out: &mut Outcome,
    ) -> Result<bool, ApplyFailure> {
        let rts = remote_ts(meta);
        let rel = self.rel(oid)?;
        let keyed = matches!(rel.locator, Locator::Key(_));
        let tombstone = match (&target, keyed) {
            (None, true) => self.fetch_tombstone(rel, &loc_params).await?,
            _ => None,
        };
        let truncate = self.truncate_if_gone(rel, &target).await?;
        let found = Found {
            target,
            tombstone,
            collisions: Vec::new(),
            truncate,
        };
        let facts = self.facts(op, &found, rts);
        let key = key_of(rel, &remote_old);
        let remote_old = Some(remote_old);
        let (c, plan) = match self
            .judge(rel, meta, facts.clone(), &found, &remote_old, &remote_new)
            .await?
        {
            Judgement::Apply => {
                let plan = classify::plan_routine(&facts);
                if let Some(t) = &found.target {
                    self.delete_versions(rel, &[t]).await?;
                    out.rows += 1;
                }
                if plan.tombstone && keyed {
                    self.write_tombstone(rel, &loc_params).await?;
                }
                if let Some(t) = found.target.clone() {
                    self.note_routine(&t);
                }
                return Ok(false);
            }
            Judgement::Truncated(kind) => {
                self.log_truncated(oid, meta, kind, &found, remote_old, remote_new, out)
                    .await?;
                return Ok(false);
            }
            Judgement::Decided(d) => *d,
        };
        let kind = c.kind;
        let rel = self.rel(oid)?;
        self.carry_out(
            rel,
            meta,
            &plan,
            &found,
            &loc_params,
            remote_old.as_ref(),
            &c,
        )
        .await?;
        if plan.delete_target {
            out.rows += 1;
        }
        // A compensating delete usually finds its key already gone (the
        // collision removed it here too): expected, not a conflict.
        if !(compensating && kind == ConflictType::DeleteMissing) {
            self.log_conflict(rel, meta, &c, key, plan.label, out)
                .await?;
        }
        Ok(matches!(plan.write, Write::Row(_)))
    }
}

/// What judging a change came to.
enum Judgement {
    Apply,
    /// Older than the table's truncate (logged as this type).
    Truncated(ConflictType),
    Decided(Box<(Conflict, Plan)>),
}

/// The versions one change is judged against, as found under locks.
struct Found {
    target: Option<Version>,
    tombstone: Option<Version>,
    collisions: Vec<Version>,
    truncate: Option<Version>,
}

impl Found {
    fn version(&self, local: Local) -> Option<&Version> {
        match local {
            Local::Target => self.target.as_ref(),
            Local::Tombstone => self.tombstone.as_ref(),
            Local::Collision(i) => self.collisions.get(i),
        }
    }
}

/// Did this update change the row's key? (pgoutput sends the old key only
/// then, or always with REPLICA IDENTITY FULL: compare.)
pub(super) fn key_changed(rel: &LocalRelation, upd: &Update, old_key: &[Param]) -> bool {
    if upd.old.is_none() || !matches!(rel.locator, Locator::Key(_)) {
        return false;
    }
    rel.key_remote
        .iter()
        .zip(old_key)
        .any(|(&i, o)| match (upd.new.columns.get(i), o) {
            (Some(ColumnValue::Text(n)), Param::Text(o)) => n != o,
            // A key column left unchanged-TOAST did not change.
            (Some(ColumnValue::UnchangedToast), _) => false,
            _ => true,
        })
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
