//! Applies remote transactions to the local node. See the module docs of
//! `apply` for the invariants this file enforces.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;

use chrono::{DateTime, Utc};

use mm_proto::Lsn;
use mm_proto::pgoutput::{
    ColumnValue, Delete, Insert, Message, OldTuple, PgTimestamp, Truncate, TupleData, Update,
};
use tokio_postgres::{Client, Statement};

use super::pipeline::{Done, OpKind, OpMeta, Pipeline};
use super::relation::LocalRelation;
use super::sql::{self, Commit};
use super::tuple::{column_count, locate, masked_locator, tuple_params};
use super::{ApplyFailure, Param};
use crate::conflict::TableResolvers;

/// Statements in flight per transaction before we wait for replies.
const PIPELINE_WINDOW: usize = 2048;
/// Transactions applied one at a time after a conflict (see `apply`).
pub(super) const CONFLICT_STREAK: u32 = 64;
/// Rows per multi-row INSERT for runs of inserts into one table: large
/// statements first, then small ones, the rest row by row (`batch_sizes`).
/// Every statement costs the backend its setup and the insert's re-check
/// call, so fewer, larger statements win.
const INSERT_BATCHES: [usize; 2] = [1000, 100];
/// PostgreSQL's limit on bind parameters per statement.
const MAX_PARAMS: usize = 65535;

/// `INSERT_BATCHES` for a table of `width` columns, within the parameter
/// limit (a size below 2 is not used).
fn batch_sizes(width: usize) -> [usize; 2] {
    let most = (MAX_PARAMS - sql::INSERT_EXTRA_PARAMS) / width.max(1);
    INSERT_BATCHES.map(|n| n.min(most))
}

/// Identity of the remote transaction being applied.
#[derive(Debug, Clone, Copy)]
pub struct TxnMeta {
    pub xid: u32,
    pub commit_lsn: Lsn,
    /// Stored as the applied progress: START_REPLICATION resumes from it.
    pub end_lsn: Lsn,
    pub commit_ts: PgTimestamp,
}

impl TxnMeta {
    /// A streamed transaction applied before its STREAM COMMIT arrived
    /// (`early.rs`): its commit LSN, end and timestamp are not known yet.
    /// The timestamp stands at `-infinity`, which makes every fast-path
    /// check that compares it conservative: an older local version from
    /// another origin is never taken as routine (`mm.routine`), any
    /// truncate counts as newer (`mm.insert_recheck`); such a change is
    /// sent to the resolver, at the commit, with the real timestamp.
    pub fn streaming(xid: u32) -> TxnMeta {
        TxnMeta {
            xid,
            commit_lsn: Lsn::INVALID,
            end_lsn: Lsn::INVALID,
            commit_ts: PgTimestamp::NEG_INFINITY,
        }
    }

    /// False while a streamed transaction is applied before its commit.
    pub fn commit_known(&self) -> bool {
        self.commit_ts != PgTimestamp::NEG_INFINITY
    }
}

/// Where a transaction's messages come from: memory for ordinary transactions,
/// the spool file for streamed ones.
pub trait ChangeSource: Send {
    fn next_message(&mut self) -> Result<Option<Message>, ApplyFailure>;
}

impl ChangeSource for std::vec::IntoIter<Message> {
    fn next_message(&mut self) -> Result<Option<Message>, ApplyFailure> {
        Ok(self.next())
    }
}

/// A transaction's changes, readable again: a transaction that meets a
/// conflict on the fast path is rolled back and applied once more with the
/// resolver, and so are the ones pipelined behind it.
pub trait Replayable: Send + Sync {
    fn open(&self) -> Result<Box<dyn ChangeSource>, ApplyFailure>;

    /// The transaction's change when it is its only one (a row insert,
    /// update or delete, with no RELATION message before it): such a
    /// transaction is applied as one statement (`sql::Commit::Fused`).
    fn single_change(&self) -> Option<Message> {
        None
    }
}

/// A transaction received whole, kept in memory until it commits here.
pub struct InMemory(pub Arc<Vec<Message>>);

struct InMemoryReader {
    msgs: Arc<Vec<Message>>,
    next: usize,
}

impl ChangeSource for InMemoryReader {
    /// Clones one message at a time (its values are shared `Bytes`), never
    /// the whole transaction.
    fn next_message(&mut self) -> Result<Option<Message>, ApplyFailure> {
        let m = self.msgs.get(self.next).cloned();
        self.next += 1;
        Ok(m)
    }
}

impl Replayable for InMemory {
    fn open(&self) -> Result<Box<dyn ChangeSource>, ApplyFailure> {
        Ok(Box::new(InMemoryReader {
            msgs: Arc::clone(&self.0),
            next: 0,
        }))
    }

    fn single_change(&self) -> Option<Message> {
        let mut change = None;
        for m in self.0.iter() {
            match m {
                Message::Insert(_) | Message::Update(_) | Message::Delete(_)
                    if change.is_none() =>
                {
                    change = Some(m)
                }
                Message::Message(msg) if is_partition_truncate(msg) => return None,
                // Nothing to apply (see `queue`).
                Message::Type(_) | Message::Message(_) | Message::Origin(_) => {}
                _ => return None,
            }
        }
        change.cloned()
    }
}

pub type TxnBody = Arc<dyn Replayable>;

/// The publisher's watermark as of some point of its stream: per origin
/// node, the newest commit timestamp it had applied (see `watermark`). Each
/// queued transaction keeps the one it was queued under, so a transaction
/// applied again after a conflict is judged by what the publisher had seen
/// when it committed it, not by a later announcement.
#[derive(Debug)]
pub struct Watermark {
    pub map: BTreeMap<String, DateTime<Utc>>,
    /// The same as `mm.routine` parameters: origin ids and timestamps.
    params: (Param, Param),
}

/// Who is applying what, and how conflicts are decided.
#[derive(Clone)]
pub struct ApplyContext {
    /// This node's name: the origin of local writes (roident 0).
    pub local_node: String,
    /// The publisher's node name.
    pub peer: String,
    pub resolvers: Arc<TableResolvers>,
    /// How to reach the publisher's PostgreSQL (its `peer_dsn`, this agent's
    /// password): for the values of unchanged-TOAST columns a conflict
    /// needs (`careful.rs`).
    pub peer_dsn: String,
    pub peer_password: Option<String>,
    /// What this node has applied from every origin (`watermark.rs`).
    pub applied: Arc<crate::watermark::Watermarks>,
    /// Shared by every stream into this node (`gate.rs`).
    pub gate: super::gate::Gate,
}

pub struct Applier {
    pub(super) client: Arc<Client>,
    pub(super) origin: String,
    pub(super) ctx: ApplyContext,
    /// Local id of the publisher's replication origin.
    pub(super) peer_roident: u32,
    /// Local origin ids -> node names (0 is this node).
    pub(super) origins: HashMap<u32, String>,
    /// The publisher's watermark in effect for the transaction being queued.
    pub(super) wm: Arc<Watermark>,
    store_watermark: Statement,
    /// Transactions queued and not yet committed, with their changes, in
    /// order: what `recover` applies again.
    pub(super) queued: VecDeque<(TxnMeta, TxnBody, Arc<Watermark>)>,
    /// Commit LSNs of this publisher's transactions an operator asked to skip.
    pub(super) skips: HashSet<Lsn>,
    /// Routine cross-origin changes: counted by `mm.routine` in a session
    /// setting on the fast path (rolled back with their transaction), and
    /// here by the careful path.
    routine_fast: u64,
    routine_careful: u64,
    routine_taken: u64,
    /// Transactions left to apply one at a time after a conflict.
    pub(super) streak: u32,
    /// Keys single-change transactions just met in conflict (`hot.rs`).
    pub(super) hot: super::hot::HotKeys,
    pub(super) relations: HashMap<u32, LocalRelation>,
    pub(super) begin: Statement,
    /// The progress guard and COMMIT, prepared once: every transaction
    /// ends with them, on the fast and the careful path.
    pub(super) advance: Statement,
    pub(super) commit: Statement,
    /// Statements sent and not yet answered, across transactions.
    pub(super) pipe: Option<Pipeline>,
    /// The progress the next queued transaction expects to find stored:
    /// the end of the transaction queued before it.
    pub(super) next_expected: Lsn,
    wal_positions: Statement,
    /// End LSN of the last remote transaction committed here.
    pub(super) last_applied: Lsn,
    /// (remote position applied, local WAL insert position when it was
    /// sampled): once local WAL is flushed past the second, the first is durable.
    unflushed: VecDeque<(Lsn, Lsn)>,
    durable: Lsn,
    /// A BEGIN was sent whose COMMIT was not: only then is there anything
    /// to roll back (a ROLLBACK outside a transaction makes PostgreSQL log
    /// a warning, once per conflict).
    txn_open: bool,
    /// The transaction being applied while it still arrives (`early.rs`),
    /// with its end LSN not known yet (its commit LSN stands in). Gone when
    /// the pipeline rolls back: it is then applied whole at its COMMIT.
    pub(super) early: Option<TxnMeta>,
    /// Orphan checks of the transaction being queued, run before its
    /// progress and commit (`fk.rs`).
    fk_pending: Vec<super::fk::FkCheck>,
    /// A connection to the publisher, opened when a conflict first needs
    /// values it did not send.
    pub(super) origin_client: Option<Client>,
    /// The careful path's statements by text (`careful.rs`, `prepared`).
    pub(super) careful_stmts: std::sync::Mutex<HashMap<String, Statement>>,
    /// The careful transaction's writes not answered yet (`deferred.rs`).
    pub(super) deferred: super::deferred::Deferred,
}

fn parse_lsn(s: Option<String>, what: &str) -> Result<Lsn, ApplyFailure> {
    match s {
        None => Ok(Lsn::INVALID),
        Some(s) => s
            .parse()
            .map_err(|e| ApplyFailure::new(None, format!("{what}: {e}"))),
    }
}

impl Applier {
    /// Opens the apply session for the stream from `peer`: replica role (no
    /// user triggers, no FK checks fired twice), the requested commit
    /// durability, and the peer's replication origin bound to the session (it
    /// tags our commits so they are never sent back out). Returns the stored
    /// progress: where the stream must resume.
    pub async fn open(
        dsn: &str,
        password: Option<&str>,
        origin: &str,
        synchronous_commit: &str,
        ctx: ApplyContext,
    ) -> Result<(Applier, Lsn), ApplyFailure> {
        let client = crate::pg::connect(dsn, password)
            .await
            .map_err(|e| ApplyFailure::new(None, e.to_string()))?;
        let pg = |e: tokio_postgres::Error| ApplyFailure::from_pg(None, &e);
        client
            .batch_execute(&format!(
                "SET session_replication_role = replica; SET synchronous_commit = {}",
                match synchronous_commit {
                    "on" | "off" | "local" | "remote_write" | "remote_apply" => synchronous_commit,
                    _ => "off",
                }
            ))
            .await
            .map_err(pg)?;
        crate::pg::bind_origin(&client, origin).await.map_err(pg)?;
        client
            .execute(
                "INSERT INTO mm.apply_progress (origin, remote_lsn) VALUES ($1, '0/0') \
                 ON CONFLICT (origin) DO NOTHING",
                &[&origin],
            )
            .await
            .map_err(pg)?;
        let row = client
            .query_one(
                "SELECT remote_lsn::text FROM mm.apply_progress WHERE origin = $1",
                &[&origin],
            )
            .await
            .map_err(pg)?;
        let start = parse_lsn(row.get(0), "stored apply progress")?;
        let begin = client.prepare("BEGIN").await.map_err(pg)?;
        let commit = client.prepare("COMMIT").await.map_err(pg)?;
        // One statement records progress (only if the previous transaction's
        // is in place: see pipeline.rs) and gives the commit the remote commit
        // timestamp through the origin (schema.rs).
        let advance = client.prepare(&sql::advance_progress()).await.map_err(pg)?;
        let wal_positions = client
            .prepare(
                "SELECT pg_catalog.pg_current_wal_insert_lsn()::text, pg_catalog.pg_current_wal_flush_lsn()::text, \
                 pg_catalog.current_setting('mm.routine_changes', true)",
            )
            .await
            .map_err(pg)?;
        let store_watermark = client
            .prepare("UPDATE mm.apply_progress SET watermark = $2::text::jsonb WHERE origin = $1")
            .await
            .map_err(pg)?;
        let stored_wm: Option<serde_json::Value> = client
            .query_one(
                "SELECT watermark FROM mm.apply_progress WHERE origin = $1",
                &[&origin],
            )
            .await
            .map_err(pg)?
            .get(0);
        let skip_rows = client
            .query(
                "SELECT commit_lsn::text FROM mm.skip_requests WHERE from_node = $1",
                &[&ctx.peer],
            )
            .await
            .map_err(pg)?;
        let mut skips = HashSet::new();
        for r in skip_rows {
            skips.insert(parse_lsn(r.get(0), "mm.skip_requests.commit_lsn")?);
        }
        let client = Arc::new(client);
        let mut applier = Applier {
            pipe: Some(Pipeline::new(Arc::clone(&client), PIPELINE_WINDOW)),
            next_expected: start,
            client,
            origin: origin.to_owned(),
            ctx,
            peer_roident: 0,
            origins: HashMap::new(),
            wm: Arc::new(Watermark {
                map: BTreeMap::new(),
                params: (Param::oid_array(&[]), Param::timestamptz_array(&[])),
            }),
            store_watermark,
            queued: VecDeque::new(),
            skips,
            routine_fast: 0,
            routine_careful: 0,
            routine_taken: 0,
            streak: 0,
            hot: Default::default(),
            relations: HashMap::new(),
            begin,
            advance,
            commit,
            wal_positions,
            last_applied: start,
            unflushed: VecDeque::new(),
            durable: Lsn::INVALID,
            txn_open: false,
            early: None,
            careful_stmts: std::sync::Mutex::new(HashMap::new()),
            deferred: Default::default(),
            fk_pending: Vec::new(),
            origin_client: None,
        };
        applier.load_origins().await?;
        if let Some(wm) = stored_wm
            .and_then(|v| serde_json::from_value::<BTreeMap<String, DateTime<Utc>>>(v).ok())
        {
            applier.install_watermark(wm).await?;
        }
        applier.peer_roident = applier
            .origins
            .iter()
            .find(|(id, n)| **id != 0 && **n == applier.ctx.peer)
            .map(|(id, _)| *id)
            .ok_or_else(|| {
                ApplyFailure::new(None, format!("replication origin {origin} vanished"))
            })?;
        // What we read is committed but, with asynchronous commit, maybe not
        // yet flushed: it only becomes durable through the same gate.
        applier.durable_progress().await?;
        Ok((applier, start))
    }

    /// The stream's counters as stored: applied transactions (counted by
    /// the progress guard in each one) and conflicts by type (the
    /// conflict log's rows from this peer), so status survives restarts.
    pub async fn stored_counters(&self) -> Result<(u64, BTreeMap<String, u64>), ApplyFailure> {
        let pg = |e: tokio_postgres::Error| ApplyFailure::from_pg(None, &e);
        let txns: i64 = self
            .client
            .query_one(
                "SELECT applied_txns FROM mm.apply_progress WHERE origin = $1",
                &[&self.origin],
            )
            .await
            .map_err(pg)?
            .try_get(0)
            .map_err(pg)?;
        let rows = self
            .client
            .query(
                "SELECT conflict_type, count(*) FROM mm.conflict_log \
                 WHERE remote_origin = $1 AND conflict_type <> 'skipped_transaction' GROUP BY 1",
                &[&self.ctx.peer],
            )
            .await
            .map_err(pg)?;
        let mut conflicts = BTreeMap::new();
        for r in rows {
            let ty: String = r.try_get(0).map_err(pg)?;
            let n: i64 = r.try_get(1).map_err(pg)?;
            conflicts.insert(ty, n.max(0) as u64);
        }
        Ok((txns.max(0) as u64, conflicts))
    }

    /// Reads the local origin ids of every `mm_<node>` origin.
    pub(super) async fn load_origins(&mut self) -> Result<(), ApplyFailure> {
        let rows = self
            .client
            .query(
                "SELECT roident, roname FROM pg_catalog.pg_replication_origin",
                &[],
            )
            .await
            .map_err(|e| ApplyFailure::from_pg(None, &e))?;
        self.origins.clear();
        self.origins.insert(0, self.ctx.local_node.clone());
        for r in rows {
            let id: u32 = r.get(0);
            let name: String = r.get(1);
            let node = name.strip_prefix("mm_").map_or(name.clone(), str::to_owned);
            self.origins.insert(id, node);
        }
        Ok(())
    }

    /// The publisher's watermark, effective for every change queued after
    /// this call (it arrived in the stream before them). Everything queued
    /// before it is committed first, then it is stored with the progress:
    /// the stream resumes past the message that carried it (an idle stream
    /// confirms what it received), and a restarted stream without it would
    /// take routine changes for conflicts until the next announcement.
    pub async fn set_watermarks(
        &mut self,
        wm: BTreeMap<String, DateTime<Utc>>,
    ) -> Result<(), ApplyFailure> {
        self.settle_all().await?;
        let json = serde_json::to_string(&wm)
            .map_err(|e| ApplyFailure::new(None, format!("watermark: {e}")))?;
        self.client
            .execute(&self.store_watermark, &[&self.origin, &json])
            .await
            .map_err(|e| ApplyFailure::from_pg(None, &e))?;
        self.install_watermark(wm).await
    }

    async fn install_watermark(
        &mut self,
        wm: BTreeMap<String, DateTime<Utc>>,
    ) -> Result<(), ApplyFailure> {
        if wm
            .keys()
            .any(|n| !self.origins.values().any(|known| known == n))
        {
            self.load_origins().await?;
        }
        let mut ids = Vec::new();
        let mut ts = Vec::new();
        for (node, t) in &wm {
            if let Some((id, _)) = self.origins.iter().find(|(_, n)| *n == node) {
                ids.push(*id);
                ts.push(PgTimestamp::from_datetime(*t).0);
            }
        }
        self.wm = Arc::new(Watermark {
            map: wm,
            params: (Param::oid_array(&ids), Param::timestamptz_array(&ts)),
        });
        Ok(())
    }

    /// Routine cross-origin changes applied since the last call.
    pub fn take_routine(&mut self) -> u64 {
        let total = self.routine_fast + self.routine_careful;
        let n = total.saturating_sub(self.routine_taken);
        self.routine_taken = total;
        n
    }

    pub(super) fn count_routine(&mut self) {
        self.routine_careful += 1;
    }

    /// For a careful transaction judged again: its first try's routine
    /// changes rolled back with it.
    pub(super) fn routine_careful_count(&self) -> u64 {
        self.routine_careful
    }

    pub(super) fn set_routine_careful_count(&mut self, n: u64) {
        self.routine_careful = n;
    }

    fn guard_params(&self, txn: &TxnMeta) -> [Param; 4] {
        [
            Param::oid(self.peer_roident),
            Param::timestamptz(txn.commit_ts.0),
            self.wm.params.0.clone(),
            self.wm.params.1.clone(),
        ]
    }

    /// The highest applied remote position whose local commit is flushed to
    /// disk: the only position we may report to the publisher as flushed.
    /// Sampling the local WAL insert position after the last commit and
    /// waiting for the flush position to pass it is the same rule as
    /// PostgreSQL's own get_flush_position, at the granularity of our ticks.
    pub async fn durable_progress(&mut self) -> Result<Lsn, ApplyFailure> {
        self.settle_all().await?;
        let row = self
            .client
            .query_one(&self.wal_positions, &[])
            .await
            .map_err(|e| ApplyFailure::from_pg(None, &e))?;
        let insert = parse_lsn(row.get(0), "pg_current_wal_insert_lsn")?;
        let flush = parse_lsn(row.get(1), "pg_current_wal_flush_lsn")?;
        let routine: Option<String> = row.get(2);
        if let Some(n) = routine.and_then(|v| v.parse::<u64>().ok()) {
            self.routine_fast = n;
        }
        if self
            .unflushed
            .back()
            .is_none_or(|(r, _)| *r < self.last_applied)
        {
            self.unflushed.push_back((self.last_applied, insert));
        }
        while let Some(&(remote, local)) = self.unflushed.front() {
            if local > flush {
                break;
            }
            self.durable = self.durable.max(remote);
            self.unflushed.pop_front();
        }
        Ok(self.durable)
    }

    /// Waits until everything queued is answered; conflicts met on the way
    /// are resolved (which queues transactions again, hence the loop).
    pub(super) async fn settle_all(&mut self) -> Result<(), ApplyFailure> {
        loop {
            match self.settle(0).await {
                Err(f) if f.conflict => self.recover(f).await?,
                r => return r,
            }
        }
    }

    /// Applies a relation description that arrived outside a transaction.
    pub async fn relation(
        &mut self,
        rel: mm_proto::pgoutput::Relation,
    ) -> Result<(), ApplyFailure> {
        let local = LocalRelation::resolve(&self.client, rel).await?;
        self.relations.insert(local.remote.oid, local);
        Ok(())
    }

    /// Queues one remote transaction as one local transaction. It is sent
    /// but not necessarily committed when this returns: finished
    /// transactions come out of `take_done`, failures out of this call or of
    /// `settle` (carrying the failed transaction). A conflict met on the way
    /// is resolved here (`recover`), not returned.
    pub async fn apply(&mut self, meta: &TxnMeta, body: TxnBody) -> Result<(), ApplyFailure> {
        self.queued
            .push_back((*meta, Arc::clone(&body), Arc::clone(&self.wm)));
        if self.streak > 0 && self.touches_hot_key(meta, &body) {
            self.streak -= 1;
            return self.apply_hot(meta, &body).await;
        }
        let mut r = self.queue_fast(meta, &body).await;
        // Right after a conflict, more are likely (hot rows): wait for each
        // transaction's reply, so the next conflict rolls back only itself.
        if r.is_ok() && self.streak > 0 {
            self.streak -= 1;
            r = self.settle(0).await;
        }
        match r {
            Err(f) if f.conflict => self.recover(f).await,
            r => r,
        }
    }

    /// Whether `body` is one change to a key that just conflicted.
    fn touches_hot_key(&self, meta: &TxnMeta, body: &TxnBody) -> bool {
        !self.skips.contains(&meta.commit_lsn)
            && self.single_key(body).is_some_and(|k| self.hot.contains(k))
    }

    /// The key of `body`'s change when it is its only one (`hot.rs`).
    pub(super) fn single_key(&self, body: &TxnBody) -> Option<u64> {
        let change = body.single_change()?;
        let oid = match &change {
            Message::Insert(i) => i.relation_oid,
            Message::Update(u) => u.relation_oid,
            Message::Delete(d) => d.relation_oid,
            _ => return None,
        };
        super::hot::key_of(self.relations.get(&oid)?, &change)
    }

    /// A transaction on a hot key: the careful path directly, once
    /// everything queued before it has committed (commit order). A conflict
    /// among those is recovered as any other, this transaction with them.
    async fn apply_hot(&mut self, meta: &TxnMeta, body: &TxnBody) -> Result<(), ApplyFailure> {
        match self.settle(0).await {
            Err(f) if f.conflict => return self.recover(f).await,
            r => r?,
        }
        // Nothing is in flight now; this sets the progress it expects.
        let again = self.roll_back_pipeline().await?;
        self.queued.extend(again);
        self.apply_careful(meta, body, false).await?;
        self.next_expected = meta.end_lsn;
        Ok(())
    }

    pub(super) async fn queue_fast(
        &mut self,
        meta: &TxnMeta,
        body: &TxnBody,
    ) -> Result<(), ApplyFailure> {
        let guard = self.enter_gate().await.map_err(|mut f| {
            f.txn.get_or_insert(*meta);
            f
        })?;
        let mut pipe = self.take_pipe()?;
        pipe.hold(meta.end_lsn, guard);
        // A skipped transaction needs its audit row: never one statement.
        // Tables in foreign keys need their orphan checks before the commit.
        let single = (!self.skips.contains(&meta.commit_lsn))
            .then(|| body.single_change())
            .flatten()
            .filter(|m| !self.in_foreign_key(m));
        let r = match single {
            Some(change) => self.queue_fused(&mut pipe, meta, change).await,
            None => match body.open() {
                Ok(mut src) => self.queue(&mut pipe, meta, src.as_mut()).await,
                Err(e) => Err(e),
            },
        };
        self.pipe = Some(pipe);
        r.map_err(|mut f| {
            f.txn.get_or_insert(*meta);
            f
        })?;
        self.next_expected = meta.end_lsn;
        Ok(())
    }

    /// The gate (`gate.rs`), shared, for the next fast-path transaction.
    /// When a careful transaction holds it or waits for it, this stream's
    /// queued transactions must commit first, letting go of their share:
    /// otherwise the careful one waits for them and they for it.
    pub(super) async fn enter_gate(&mut self) -> Result<super::gate::Shared, ApplyFailure> {
        if let Some(g) = self.ctx.gate.try_shared() {
            return Ok(g);
        }
        self.settle(0).await?;
        if !self.txn_open
            && let Some(p) = self.pipe.as_mut()
        {
            p.release_all();
        }
        Ok(self.ctx.gate.shared().await)
    }

    /// A fast-path statement met a conflict in a queued transaction: every
    /// transaction from that one on rolls back (the progress guard makes the
    /// later ones fail). Waits them out, applies the conflicting one with
    /// the resolver (one statement at a time), and queues the rest again.
    /// Invariant (commit order, exactly-once): the same transactions commit,
    /// in the same order, each once.
    pub async fn recover(&mut self, failure: ApplyFailure) -> Result<(), ApplyFailure> {
        debug_assert!(failure.conflict);
        let pending = self.roll_back_pipeline().await?;
        if let Some(t) = failure.txn
            && pending
                .front()
                .is_some_and(|(m, _, _)| m.end_lsn != t.end_lsn)
        {
            tracing::debug!(failed = %t.commit_lsn, "conflict reported behind the first uncommitted transaction");
        }
        let latest = Arc::clone(&self.wm);
        let mut first = true;
        // The first is the one that met the conflict; the others are applied
        // one at a time: with conflicts dense, queuing them all again would
        // roll them all back again at the next one. Those on a key that just
        // conflicted go to the careful path without a fast attempt (`hot.rs`).
        for (m, b, w) in pending {
            self.wm = Arc::clone(&w);
            self.queued.push_back((m, Arc::clone(&b), w));
            // Some(rolled back first): to the careful path.
            let careful = if std::mem::take(&mut first) {
                Some(true)
            } else if self.touches_hot_key(&m, &b) {
                Some(false)
            } else {
                match self.queue_fast(&m, &b).await {
                    Ok(()) => self.settle(0).await,
                    Err(f) => Err(f),
                }
                .map_or_else(
                    |f| if f.conflict { Ok(Some(true)) } else { Err(f) },
                    |()| Ok(None),
                )?
            };
            if let Some(rolled_back) = careful {
                // Only this transaction is in flight (or nothing).
                let again = self.roll_back_pipeline().await?;
                self.queued.extend(again);
                self.apply_careful(&m, &b, rolled_back).await?;
                self.next_expected = m.end_lsn;
            }
        }
        self.wm = latest;
        self.streak = CONFLICT_STREAK;
        Ok(())
    }

    /// Waits out every statement in flight and rolls back whatever is open.
    /// Returns the queued transactions that did not commit, in order (taken
    /// out of the queue), and sets the progress the first of them expects.
    #[allow(clippy::type_complexity)]
    pub(super) async fn roll_back_pipeline(
        &mut self,
    ) -> Result<VecDeque<(TxnMeta, TxnBody, Arc<Watermark>)>, ApplyFailure> {
        let mut pipe = self.take_pipe()?;
        pipe.drain().await;
        let committed: Vec<Lsn> = pipe.done.iter().map(|d| d.meta.end_lsn).collect();
        self.pipe = Some(pipe);
        // Whatever was left open (a transaction queued only in part).
        self.early = None;
        if std::mem::take(&mut self.txn_open) {
            self.client
                .batch_execute("ROLLBACK")
                .await
                .map_err(|e| ApplyFailure::from_pg(None, &e))?;
        }
        // The end of the last committed one is what the next one finds.
        self.next_expected = committed
            .last()
            .copied()
            .unwrap_or(self.last_applied)
            .max(self.last_applied);
        Ok(std::mem::take(&mut self.queued)
            .into_iter()
            .filter(|(m, _, _)| !committed.contains(&m.end_lsn) && m.end_lsn > self.last_applied)
            .collect())
    }

    async fn queue(
        &mut self,
        pipe: &mut Pipeline,
        meta: &TxnMeta,
        src: &mut dyn ChangeSource,
    ) -> Result<(), ApplyFailure> {
        self.queue_begin(pipe, meta).await?;
        if self.skips.contains(&meta.commit_lsn) {
            return self.queue_skip(pipe, meta, src).await;
        }
        self.queue_changes(pipe, meta, src).await?;
        self.finish_queue(pipe, meta).await
    }

    /// Opens a transaction's local transaction: BEGIN.
    pub(super) async fn queue_begin(
        &mut self,
        pipe: &mut Pipeline,
        meta: &TxnMeta,
    ) -> Result<(), ApplyFailure> {
        self.fk_pending.clear();
        self.txn_open = true;
        pipe.push(
            &self.begin.clone(),
            Vec::new(),
            control_op(OpKind::Control, *meta),
        )
        .await
    }

    /// Queues the changes `src` holds, after `queue_begin`: all of a
    /// transaction's, or (`early.rs`) the next part of one still arriving.
    pub(super) async fn queue_changes(
        &mut self,
        pipe: &mut Pipeline,
        meta: &TxnMeta,
        src: &mut dyn ChangeSource,
    ) -> Result<(), ApplyFailure> {
        let txn = *meta;
        // Formatted once per call, not per row.
        let guard = self.guard_params(&txn);
        let mut next = src.next_message()?;
        while let Some(msg) = next.take() {
            match msg {
                Message::Relation(r) => {
                    // Catalog lookups need replies before we can go on; they
                    // are rare (first use, or a schema change), so settle first.
                    pipe.settle(0).await?;
                    self.relation(r).await?;
                }
                Message::Insert(i) => {
                    // Consecutive inserts into one table go out as multi-row
                    // INSERTs: one protocol round per batch instead of per row.
                    let oid = i.relation_oid;
                    let most = batch_sizes(self.rel(oid)?.local_names.len())[0];
                    let mut batch = vec![i];
                    loop {
                        match src.next_message()? {
                            Some(Message::Insert(j))
                                if j.relation_oid == oid && batch.len() < most =>
                            {
                                batch.push(j)
                            }
                            other => {
                                next = other;
                                break;
                            }
                        }
                    }
                    self.insert_batch(pipe, txn, oid, batch).await?;
                    continue;
                }
                Message::Update(u) => {
                    self.note_fk(u.relation_oid, Some(&u.new), u.old.as_ref())?;
                    self.update(pipe, txn, &guard, u, None).await?
                }
                Message::Delete(d) => {
                    self.note_fk(d.relation_oid, None, Some(&d.old))?;
                    self.delete(pipe, txn, &guard, d, None).await?
                }
                // A truncate's version is its commit timestamp: it wins over
                // older rows only. Unknown yet: applied at the commit.
                Message::Truncate(_) if !txn.commit_known() => {
                    return Err(ApplyFailure::to_careful(
                        None,
                        "a truncate before its commit",
                    ));
                }
                Message::Message(m) if !txn.commit_known() && is_partition_truncate(&m) => {
                    return Err(ApplyFailure::to_careful(
                        None,
                        "a truncate before its commit",
                    ));
                }
                Message::Truncate(t) => self.truncate(pipe, txn, t).await?,
                Message::Message(m) if super::compensation::is_compensation(&m) => {
                    return Err(ApplyFailure::to_careful(None, "a compensating delete"));
                }
                Message::Message(m) if is_partition_truncate(&m) => {
                    let stmt = Self::prepare_settled(
                        pipe,
                        &self.client,
                        "partition truncate",
                        sql::APPLY_PARTITION_TRUNCATE,
                    )
                    .await?;
                    let params = partition_truncate_params(&m, &txn);
                    push_row(
                        0,
                        pipe,
                        &stmt,
                        params,
                        OpKind::Truncate,
                        Arc::from("partition truncate"),
                        txn,
                        Commit::Later,
                    )
                    .await?
                }
                // Types are described for binary mode; we bind text. Other
                // logical messages and origins carry nothing to apply here.
                Message::Type(_) | Message::Message(_) | Message::Origin(_) => {}
                other => {
                    return Err(ApplyFailure::new(
                        None,
                        format!("unexpected message inside a transaction: {}", other.name()),
                    ));
                }
            }
            next = src.next_message()?;
        }
        Ok(())
    }

    /// A transaction whose only change is `change`, as one statement that
    /// also records progress: no BEGIN, no separate progress call, no
    /// COMMIT. The invariants hold as for `queue`: the statement fails as a
    /// whole (row missing, version needing the resolver, progress not where
    /// this transaction expects it), and then nothing of it commits.
    async fn queue_fused(
        &mut self,
        pipe: &mut Pipeline,
        meta: &TxnMeta,
        change: Message,
    ) -> Result<(), ApplyFailure> {
        let txn = *meta;
        let progress = self.progress_params(meta);
        match change {
            Message::Insert(i) => self.insert(pipe, txn, i, Some(progress)).await,
            Message::Update(u) => {
                let guard = self.guard_params(&txn);
                self.update(pipe, txn, &guard, u, Some(progress)).await
            }
            Message::Delete(d) => {
                let guard = self.guard_params(&txn);
                self.delete(pipe, txn, &guard, d, Some(progress)).await
            }
            other => Err(ApplyFailure::new(
                None,
                format!("not a row change: {}", other.name()),
            )),
        }
    }

    /// Progress guard parameters: this transaction's end on top of
    /// the previous one's.
    pub(super) fn progress_params(&self, meta: &TxnMeta) -> [Param; sql::PROGRESS_PARAMS] {
        [
            Param::text(self.origin.clone()),
            Param::text(self.next_expected.to_string()),
            Param::text(meta.end_lsn.to_string()),
            Param::timestamptz(meta.commit_ts.0),
        ]
    }

    /// Records progress (on top of the previous transaction's) and commits.
    pub(super) async fn finish_queue(
        &mut self,
        pipe: &mut Pipeline,
        meta: &TxnMeta,
    ) -> Result<(), ApplyFailure> {
        let txn = *meta;
        let control = |kind| control_op(kind, txn);
        self.push_fk_checks(pipe, meta).await?;
        pipe.push(
            &self.advance.clone(),
            self.progress_params(meta).to_vec(),
            control(OpKind::Control),
        )
        .await?;
        // Sent, the COMMIT ends the transaction either way (an aborted one
        // rolls back).
        self.txn_open = false;
        pipe.push(&self.commit.clone(), Vec::new(), control(OpKind::Commit))
            .await
    }

    fn note_fk(
        &mut self,
        oid: u32,
        new: Option<&TupleData>,
        old: Option<&OldTuple>,
    ) -> Result<(), ApplyFailure> {
        let rel = self.rel(oid)?;
        if rel.fks.is_some() {
            let checks = super::fk::checks(rel, new, old);
            self.fk_pending.extend(checks);
        }
        Ok(())
    }

    /// The statement of an orphan check, prepared once per constraint (the
    /// SQL text is built only then: this runs for every row of such tables).
    pub(super) async fn fk_statement(
        &mut self,
        pipe: Option<&mut Pipeline>,
        check: &super::fk::FkCheck,
    ) -> Result<(Statement, Arc<str>), ApplyFailure> {
        let rel = self.rel(check.oid)?;
        let slot = (check.as_child, check.index);
        let fks = rel
            .fks
            .clone()
            .ok_or_else(|| ApplyFailure::new(Some(&*rel.display), "foreign keys vanished"))?;
        let fk = if check.as_child {
            &fks.as_child[check.index]
        } else {
            &fks.as_parent[check.index]
        };
        let child: Arc<str> = Arc::from(fk.child_display.as_str());
        if let Some(s) = rel.fk_stmts.get(&slot) {
            return Ok((s.clone(), child));
        }
        let text = if check.as_child {
            super::fk::child_check_sql(fk, &self.ctx.peer)
        } else {
            super::fk::parent_check_sql(fk, &self.ctx.peer)
        };
        let display = Arc::clone(&rel.display);
        let stmt = match pipe {
            Some(p) => Self::prepare_settled(p, &self.client, &display, &text).await?,
            None => Self::prepare(&self.client, &display, &text).await?,
        };
        self.rel_mut(check.oid)?.fk_stmts.insert(slot, stmt.clone());
        Ok((stmt, child))
    }

    /// Queues the transaction's orphan checks (after all its changes, so a
    /// parent inserted later in it counts).
    async fn push_fk_checks(
        &mut self,
        pipe: &mut Pipeline,
        meta: &TxnMeta,
    ) -> Result<(), ApplyFailure> {
        for check in std::mem::take(&mut self.fk_pending) {
            let (stmt, child) = self.fk_statement(Some(pipe), &check).await?;
            let mut params = vec![
                Param::timestamptz(meta.commit_ts.0),
                Param::text(meta.commit_lsn.to_string()),
            ];
            params.extend(check.params);
            pipe.push(
                &stmt,
                params,
                OpMeta {
                    kind: OpKind::OrphanCheck,
                    relation: Some(child),
                    txn: *meta,
                    rows: 0,
                    commits: false,
                },
            )
            .await?;
        }
        Ok(())
    }

    pub(super) fn take_pipe(&mut self) -> Result<Pipeline, ApplyFailure> {
        self.pipe.take().ok_or_else(|| {
            ApplyFailure::new(None, "apply session unusable after an earlier failure")
        })
    }

    /// Waits until at most `keep` statements are in flight. Cancel-safe (the
    /// stream's select loop drops it when a message arrives first): the
    /// pipeline is borrowed in place, never taken out.
    pub async fn settle(&mut self, keep: usize) -> Result<(), ApplyFailure> {
        let Some(pipe) = self.pipe.as_mut() else {
            return Err(ApplyFailure::new(
                None,
                "apply session unusable after an earlier failure",
            ));
        };
        let r = pipe.settle(keep).await;
        if let Some(d) = pipe.done.back() {
            self.last_applied = self.last_applied.max(d.meta.end_lsn);
        }
        r
    }

    /// Waits for the next reply (for an idle stream: keeps results flowing).
    pub async fn settle_next(&mut self) -> Result<(), ApplyFailure> {
        let keep = self.in_flight().saturating_sub(1);
        self.settle(keep).await
    }

    pub fn in_flight(&self) -> usize {
        self.pipe.as_ref().map_or(0, Pipeline::in_flight)
    }

    pub(super) fn push_done(&mut self, d: Done) {
        if let Some(p) = self.pipe.as_mut() {
            p.done.push_back(d);
        }
    }

    /// Transactions committed since the last call, in commit order.
    pub fn take_done(&mut self) -> Vec<Done> {
        let done: Vec<Done> = self
            .pipe
            .as_mut()
            .map(|p| p.done.drain(..).collect())
            .unwrap_or_default();
        if let Some(d) = done.last() {
            self.last_applied = self.last_applied.max(d.meta.end_lsn);
            // Committed: their changes are no longer needed for a redo.
            while self
                .queued
                .front()
                .is_some_and(|(m, _, _)| m.end_lsn <= d.meta.end_lsn)
            {
                self.queued.pop_front();
            }
        }
        done
    }

    /// Could the publisher have applied a change from a third origin,
    /// committed before `ts`, that this node has not applied? With two
    /// nodes never; otherwise unless everything from every third origin up
    /// to `ts` is applied here. Clock skew aside, like last-writer-wins.
    ///
    /// "Everything up to `ts`" needs a margin: an origin's commit
    /// timestamps are taken before its commit records are ordered in its
    /// WAL, so concurrent commits reach us slightly out of timestamp order
    /// (the same reason the tombstone purge keeps one, `watermark.rs`).
    /// Having applied a commit stamped `ts` from X does not mean X's commit
    /// stamped `ts - 1 ms` is here yet.
    pub(super) fn base_may_be_stale(&self, ts: DateTime<Utc>) -> bool {
        let here = self.ctx.applied.applied_snapshot();
        let need = ts + crate::watermark::ORDER_MARGIN;
        self.wm
            .map
            .keys()
            .chain(here.keys())
            .filter(|o| **o != self.ctx.peer && **o != self.ctx.local_node)
            .any(|o| here.get(o).is_none_or(|a| *a < need))
    }

    fn in_foreign_key(&self, m: &Message) -> bool {
        let oid = match m {
            Message::Insert(i) => i.relation_oid,
            Message::Update(u) => u.relation_oid,
            Message::Delete(d) => d.relation_oid,
            _ => return false,
        };
        self.relations.get(&oid).is_some_and(|r| r.fks.is_some())
    }

    pub(super) fn rel(&self, oid: u32) -> Result<&LocalRelation, ApplyFailure> {
        self.relations.get(&oid).ok_or_else(|| {
            ApplyFailure::new(
                None,
                format!("change for relation oid {oid} arrived before its RELATION message"),
            )
        })
    }

    fn rel_mut(&mut self, oid: u32) -> Result<&mut LocalRelation, ApplyFailure> {
        self.relations.get_mut(&oid).ok_or_else(|| {
            ApplyFailure::new(
                None,
                format!("change for relation oid {oid} arrived before its RELATION message"),
            )
        })
    }

    /// Prepares a statement needed mid-transaction. The pipeline is settled
    /// first: a prepare waits for its reply, and replies arrive in order.
    pub(super) async fn prepare_settled(
        pipe: &mut Pipeline,
        client: &Client,
        display: &str,
        text: &str,
    ) -> Result<Statement, ApplyFailure> {
        pipe.settle(0).await?;
        Self::prepare(client, display, text).await
    }

    /// Takes the client, not `&self`: the pipeline's futures make `Applier`
    /// non-`Sync`, so `&Applier` must not be held across an await.
    async fn prepare(
        client: &Client,
        display: &str,
        text: &str,
    ) -> Result<Statement, ApplyFailure> {
        client
            .prepare(text)
            .await
            .map_err(|e| ApplyFailure::from_pg(Some(display), &e))
    }

    /// Inserts rows of one relation: full batches as one multi-row INSERT
    /// (a single statement per batch size keeps the cache small), the rest
    /// row by row.
    async fn insert_batch(
        &mut self,
        pipe: &mut Pipeline,
        txn: TxnMeta,
        oid: u32,
        rows: Vec<Insert>,
    ) -> Result<(), ApplyFailure> {
        {
            let rel = self.rel(oid)?;
            if rel.fks.is_some() {
                let checks: Vec<_> = rows
                    .iter()
                    .flat_map(|i| super::fk::checks(rel, Some(&i.new), None))
                    .collect();
                self.fk_pending.extend(checks);
            }
        }
        let width = self.rel(oid)?.local_names.len();
        let mut done = 0;
        for (slot, n) in batch_sizes(width).into_iter().enumerate() {
            while n >= 2 && rows.len() - done >= n {
                let chunk = &rows[done..done + n];
                done += n;
                let rel = self.rel(oid)?;
                let display = Arc::clone(&rel.display);
                let mut params = Vec::with_capacity(width * n + 1);
                for ins in chunk {
                    params.extend(tuple_params(&ins.new, rel, None)?);
                }
                params.push(Param::timestamptz(txn.commit_ts.0));
                let stmt = match &rel.insert_batch[slot] {
                    Some(s) => s.clone(),
                    None => {
                        let text = fast_insert_sql(rel, n, Commit::Later);
                        let s = Self::prepare_settled(pipe, &self.client, &display, &text).await?;
                        self.rel_mut(oid)?.insert_batch[slot] = Some(s.clone());
                        s
                    }
                };
                push_row(
                    n as u64,
                    pipe,
                    &stmt,
                    params,
                    OpKind::Insert,
                    display,
                    txn,
                    Commit::Later,
                )
                .await?;
            }
        }
        for ins in rows.into_iter().skip(done) {
            self.insert(pipe, txn, ins, None).await?;
        }
        Ok(())
    }

    /// One row; `progress` makes it the whole transaction (`Commit::Fused`).
    async fn insert(
        &mut self,
        pipe: &mut Pipeline,
        txn: TxnMeta,
        ins: Insert,
        progress: Option<[Param; sql::PROGRESS_PARAMS]>,
    ) -> Result<(), ApplyFailure> {
        let rel = self.rel(ins.relation_oid)?;
        let mut params = tuple_params(&ins.new, rel, None)?;
        params.push(Param::timestamptz(txn.commit_ts.0));
        let display = Arc::clone(&rel.display);
        let commit = commit_at(&mut params, progress);
        let slot = usize::from(commit != Commit::Later);
        let stmt = match &rel.insert[slot] {
            Some(s) => s.clone(),
            None => {
                let text = fast_insert_sql(rel, 1, commit);
                let s = Self::prepare_settled(pipe, &self.client, &display, &text).await?;
                self.rel_mut(ins.relation_oid)?.insert[slot] = Some(s.clone());
                s
            }
        };
        push_row(1, pipe, &stmt, params, OpKind::Insert, display, txn, commit).await
    }

    async fn update(
        &mut self,
        pipe: &mut Pipeline,
        txn: TxnMeta,
        guard: &[Param; 4],
        mut upd: Update,
        progress: Option<[Param; sql::PROGRESS_PARAMS]>,
    ) -> Result<(), ApplyFailure> {
        // Unchanged TOAST means "as in the publisher's row". That row may
        // hold a change from a third node this node has not applied yet
        // (its stream lags): then the local value is not the publisher's,
        // and the later change would lose to this one here but not there.
        // Take the values from the publisher instead (`fetch_unchanged`).
        // Whether to depends on the commit timestamp: when it is not known
        // yet, the change is applied at the commit.
        let unchanged = |u: &Update| {
            u.new
                .columns
                .iter()
                .any(|c| matches!(c, ColumnValue::UnchangedToast))
        };
        if !txn.commit_known() && unchanged(&upd) {
            return Err(ApplyFailure::to_careful(
                None,
                "unchanged TOAST before the commit",
            ));
        }
        if let Some(ts) = txn.commit_ts.to_datetime()
            && unchanged(&upd)
            && self.base_may_be_stale(ts)
            && let super::careful::OriginRow::Fetched(full) =
                self.fetch_unchanged(upd.relation_oid, &upd.new, ts).await?
        {
            upd.new = full;
        }
        let rel = self.rel(upd.relation_oid)?;
        let display = Arc::clone(&rel.display);
        let set_mask = rel.set_mask(&upd.new);
        if set_mask.len() != rel.local_names.len() {
            return Err(column_count(rel, set_mask.len()));
        }
        let mut params = tuple_params(&upd.new, rel, Some(&set_mask))?;
        let (match_mask, match_params) = locate(rel, upd.old.as_ref(), Some(&upd.new))?;
        // A key change is a delete of the old key and an insert at the new
        // one, each judged on its own key (careful::careful_move).
        if super::careful::key_changed(rel, &upd, &match_params) {
            return Err(ApplyFailure::to_careful(Some(&display), "a key change"));
        }
        let loc_params = match_params.len();
        params.extend(match_params);
        params.extend(guard.iter().cloned());
        let commit = commit_at(&mut params, progress);
        let key = (set_mask, match_mask, commit);
        let stmt = match rel.update.get(&key) {
            Some(s) => s.clone(),
            None => {
                let set_cols: Vec<&str> = rel
                    .local_names
                    .iter()
                    .zip(&key.0)
                    .filter(|(_, skip)| !**skip)
                    .map(|(n, _)| n.as_str())
                    .collect();
                let text = sql::fast_update(
                    &rel.table_sql,
                    &set_cols,
                    &masked_locator(rel, &key.1),
                    loc_params,
                    commit,
                );
                let s = Self::prepare_settled(pipe, &self.client, &display, &text).await?;
                self.rel_mut(upd.relation_oid)?
                    .update
                    .insert(key, s.clone());
                s
            }
        };
        push_row(1, pipe, &stmt, params, OpKind::Update, display, txn, commit).await
    }

    async fn delete(
        &mut self,
        pipe: &mut Pipeline,
        txn: TxnMeta,
        guard: &[Param; 4],
        del: Delete,
        progress: Option<[Param; sql::PROGRESS_PARAMS]>,
    ) -> Result<(), ApplyFailure> {
        let rel = self.rel(del.relation_oid)?;
        let display = Arc::clone(&rel.display);
        let (match_mask, mut params) = locate(rel, Some(&del.old), None)?;
        let loc_params = params.len();
        params.extend(guard.iter().cloned());
        let commit = commit_at(&mut params, progress);
        let key = (match_mask, commit);
        let stmt = match rel.delete.get(&key) {
            Some(s) => s.clone(),
            None => {
                let text = sql::fast_delete(
                    &rel.table_sql,
                    &masked_locator(rel, &key.0),
                    loc_params,
                    rel.relid,
                    rel.key_names().as_deref(),
                    commit,
                );
                let s = Self::prepare_settled(pipe, &self.client, &display, &text).await?;
                self.rel_mut(del.relation_oid)?
                    .delete
                    .insert(key, s.clone());
                s
            }
        };
        push_row(1, pipe, &stmt, params, OpKind::Delete, display, txn, commit).await
    }

    async fn truncate(
        &mut self,
        pipe: &mut Pipeline,
        txn: TxnMeta,
        t: Truncate,
    ) -> Result<(), ApplyFailure> {
        let (display, params) = self.truncate_params(&txn, &t)?;
        let stmt = Self::prepare_settled(pipe, &self.client, &display, sql::APPLY_TRUNCATE).await?;
        push_row(
            0,
            pipe,
            &stmt,
            params,
            OpKind::Truncate,
            display,
            txn,
            Commit::Later,
        )
        .await
    }

    /// The tables of a TRUNCATE (shown as one relation) and the parameters
    /// of `sql::APPLY_TRUNCATE`: the truncate wins over every older row on
    /// every node and loses to newer ones.
    pub(super) fn truncate_params(
        &self,
        txn: &TxnMeta,
        t: &Truncate,
    ) -> Result<(Arc<str>, Vec<Param>), ApplyFailure> {
        let mut names = Vec::with_capacity(t.relation_oids.len());
        let mut oids = Vec::with_capacity(t.relation_oids.len());
        for oid in &t.relation_oids {
            let rel = self.rel(*oid)?;
            names.push(rel.display.to_string());
            oids.push(rel.relid);
        }
        Ok((
            Arc::from(names.join(", ").as_str()),
            vec![
                Param::oid_array(&oids),
                Param::timestamptz(txn.commit_ts.0),
                Param::text(t.cascade.to_string()),
                Param::text(t.restart_identity.to_string()),
            ],
        ))
    }
}

fn fast_insert_sql(rel: &LocalRelation, rows: usize, commit: Commit) -> String {
    let cols: Vec<&str> = rel.local_names.iter().map(String::as_str).collect();
    let types: Vec<&str> = rel.local_types.iter().map(String::as_str).collect();
    sql::fast_insert(
        &rel.table_sql,
        &cols,
        &types,
        rows,
        rel.relid,
        rel.key_names().as_deref(),
        commit,
    )
}

/// A statement of the transaction itself (BEGIN, progress, COMMIT, audit).
pub(super) fn control_op(kind: OpKind, txn: TxnMeta) -> OpMeta {
    OpMeta {
        kind,
        relation: None,
        txn,
        rows: 0,
        commits: kind == OpKind::Commit,
    }
}

/// Appends the progress parameters of a one-statement transaction after a
/// row statement's own, and says where they start.
fn commit_at(params: &mut Vec<Param>, progress: Option<[Param; sql::PROGRESS_PARAMS]>) -> Commit {
    match progress {
        None => Commit::Later,
        Some(p) => {
            let first = params.len() + 1;
            params.extend(p);
            Commit::Fused { first }
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn push_row(
    rows: u64,
    pipe: &mut Pipeline,
    stmt: &Statement,
    params: Vec<Param>,
    kind: OpKind,
    relation: Arc<str>,
    txn: TxnMeta,
    commit: Commit,
) -> Result<(), ApplyFailure> {
    let meta = OpMeta {
        kind,
        relation: Some(relation),
        txn,
        rows,
        commits: commit != Commit::Later,
    };
    pipe.push(stmt, params, meta).await
}

/// A TRUNCATE of one partition, sent by `mm.record_partition_truncate` as a
/// transactional logical message (PostgreSQL does not publish it via the
/// partition root).
pub(super) fn is_partition_truncate(m: &mm_proto::pgoutput::LogicalMessage) -> bool {
    m.transactional && m.prefix == "mm.truncate"
}

/// Parameters of `sql::APPLY_PARTITION_TRUNCATE` for such a message.
pub(super) fn partition_truncate_params(
    m: &mm_proto::pgoutput::LogicalMessage,
    txn: &TxnMeta,
) -> Vec<Param> {
    vec![
        Param::text(String::from_utf8_lossy(&m.content).into_owned()),
        Param::timestamptz(txn.commit_ts.0),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_batches_stay_within_the_parameter_limit() {
        assert_eq!(batch_sizes(3), [1000, 100]);
        // 65534 params for the rows: 200 columns fit 327 rows.
        assert_eq!(batch_sizes(200), [327, 100]);
        assert_eq!(batch_sizes(1000), [65, 65]);
        // Too wide for two rows: row by row (sizes below 2 are not used).
        assert_eq!(batch_sizes(40000), [1, 1]);
        for w in [1, 7, 66, 655, 656, 1600] {
            for n in batch_sizes(w) {
                assert!(
                    n * w + sql::INSERT_EXTRA_PARAMS <= MAX_PARAMS,
                    "width {w}: {n} rows"
                );
            }
        }
    }
}
