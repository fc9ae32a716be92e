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
use mm_proto::pgoutput::{ColumnValue, Delete, Insert, Message, TupleData, Update};
use serde_json::Value;
use tokio_postgres::Statement;
use tokio_postgres::types::ToSql;

use super::pipeline::Done;
use super::relation::LocalRelation;
use super::sql::{self, Locator};
use super::txn::{TxnBody, TxnMeta};
use super::{Applier, ApplyFailure, Param};
use crate::conflict::classify::{Local, Plan};
use crate::conflict::{Conflict, ConflictType};

mod judge;
mod toast;
mod versions;
mod write;

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
