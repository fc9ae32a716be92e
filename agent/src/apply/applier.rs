//! Applies remote transactions to the local node. See the module docs of
//! `apply` for the invariants this file enforces.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;

use chrono::{DateTime, Utc};

use mm_proto::Lsn;
use mm_proto::pgoutput::{Message, PgTimestamp};
use tokio_postgres::{Client, Statement};

use super::pipeline::{Done, Pipeline, Stmt, StmtNames};
use super::relation::LocalRelation;
use super::txn::{TxnBody, TxnMeta};
use super::{ApplyFailure, Param};
use crate::conflict::TableResolvers;

/// The local WAL insert and flush positions, and the session's count of
/// routine changes (`mm.routine`).
pub(super) const WAL_POSITIONS: &str = "SELECT pg_catalog.pg_current_wal_insert_lsn()::text, \
     pg_catalog.pg_current_wal_flush_lsn()::text, \
     pg_catalog.current_setting('mm.routine_changes', true)";

/// The publisher's watermark as of some point of its stream: per origin
/// node, the newest commit timestamp it had applied (see `watermark`). Each
/// queued transaction keeps the one it was queued under, so a transaction
/// applied again after a conflict is judged by what the publisher had seen
/// when it committed it, not by a later announcement.
#[derive(Debug)]
pub struct Watermark {
    pub map: BTreeMap<String, DateTime<Utc>>,
    /// The same as `mm.routine` parameters: origin ids and timestamps, and
    /// the timestamps less `watermark::ORDER_MARGIN` (`Guard::params`).
    params: (Param, Param, Param),
}

impl Watermark {
    /// No announcement yet: nothing is routine by a watermark.
    pub(super) fn none() -> Watermark {
        Watermark {
            map: BTreeMap::new(),
            params: (
                Param::oid_array(&[]),
                Param::timestamptz_array(&[]),
                Param::timestamptz_array(&[]),
            ),
        }
    }
}

/// The routine test's parameters for one transaction's statements
/// (`sql::GUARD_PARAMS`): the watermark as announced, or less the order
/// margin where a routine verdict keeps values from the local row
/// (`Guard::params`).
pub(super) struct Guard {
    peers: Param,
    ts: Param,
    wm: Arc<Watermark>,
}

impl Guard {
    /// `margin`: the watermark less `watermark::ORDER_MARGIN`. A watermark
    /// is the newest commit timestamp the publisher applied from an origin,
    /// and an origin's commit timestamps run slightly out of its commit
    /// order: it had applied that origin's commits stamped before it less
    /// the margin, not surely every one stamped before it. That is enough
    /// to tell a routine change from a conflict (the rest of the window is
    /// accepted, as in `watermark.rs`), but not to keep a column value the
    /// change did not send (unchanged TOAST) from the local row: the
    /// publisher's row may hold an older one, and this node would keep a
    /// value no other node has. Within the margin such an update goes the
    /// careful way, which takes the row from the publisher.
    pub(super) fn params(&self, margin: bool) -> [Param; 4] {
        let wm_ts = if margin {
            &self.wm.params.2
        } else {
            &self.wm.params.1
        };
        [
            self.peers.clone(),
            self.ts.clone(),
            self.wm.params.0.clone(),
            wm_ts.clone(),
        ]
    }
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
    /// needs (`careful/`).
    pub peer_dsn: String,
    pub peer_password: Option<String>,
    /// What this node has applied from every origin (`watermark.rs`).
    pub applied: Arc<crate::watermark::Watermarks>,
    /// Shared by every stream into this node (`gate.rs`).
    pub gate: super::gate::Gate,
    /// Transactions per group at most (`group.rs`); 1: never grouped.
    pub group_transactions: usize,
}

pub struct Applier {
    pub(super) client: Arc<Client>,
    pub(super) origin: String,
    pub(super) ctx: ApplyContext,
    /// Local ids of the publisher's replication origins (one per apply
    /// lane that ever ran): a version any of them wrote is the publisher's.
    pub(super) peer_roidents: Vec<u32>,
    /// `peer_roidents` encoded once (`oid[]`): bound to every fast-path
    /// statement's checks.
    pub(super) peer_param: Param,
    /// Local origin ids -> node names (0 is this node).
    pub(super) origins: HashMap<u32, String>,
    /// `origins` without this node, as the ids and names parameters of
    /// `sql::fast_update_in_place`: built when the origins are read, not
    /// per statement.
    pub(super) origin_params: (Param, Param),
    /// The publisher's watermark in effect for the transaction being queued.
    pub(super) wm: Arc<Watermark>,
    pub(super) store_watermark: Statement,
    /// Transactions queued and not yet committed, with their changes, in
    /// order: what `recover` applies again.
    pub(super) queued: VecDeque<(TxnMeta, TxnBody, Arc<Watermark>)>,
    /// Commit LSNs of this publisher's transactions an operator asked to skip.
    pub(super) skips: HashSet<Lsn>,
    /// Routine cross-origin changes: counted by `mm.routine` in a session
    /// setting on the fast path (rolled back with their transaction), and
    /// here by the careful path.
    pub(super) routine_fast: u64,
    pub(super) routine_careful: u64,
    pub(super) routine_taken: u64,
    /// Transactions left to apply one at a time after a conflict.
    pub(super) streak: u32,
    /// Keys single-change transactions just met in conflict (`hot.rs`).
    pub(super) hot: super::hot::HotKeys,
    pub(super) relations: HashMap<u32, LocalRelation>,
    pub(super) begin: Stmt,
    /// The progress guard and COMMIT, prepared once: every transaction
    /// ends with them, on the fast and the careful path.
    pub(super) advance: Stmt,
    /// The progress record of a group of transactions (`group.rs`).
    pub(super) advance_group: Stmt,
    /// Transactions held to be applied as one local transaction.
    pub(super) group: super::group::Group,
    pub(super) commit: Stmt,
    /// Names of statements on the pipelined session (`pipeline.rs`).
    pub(super) stmt_names: StmtNames,
    /// Statements sent and not yet answered, across transactions.
    pub(super) pipe: Option<Pipeline>,
    /// The progress the next queued transaction expects to find stored:
    /// the end of the transaction queued before it.
    pub(super) next_expected: Lsn,
    pub(super) wal_positions: Statement,
    /// End LSN of the last remote transaction committed here.
    pub(super) last_applied: Lsn,
    /// Which applied position may be reported as flushed (`durable.rs`).
    pub(super) durability: super::durable::DurabilityGate,
    /// A BEGIN was sent whose COMMIT was not: only then is there anything
    /// to roll back (a ROLLBACK outside a transaction makes PostgreSQL log
    /// a warning, once per conflict).
    pub(super) txn_open: bool,
    /// The transaction being applied while it still arrives (`early.rs`),
    /// with its end LSN not known yet (its commit LSN stands in). Gone when
    /// the pipeline rolls back: it is then applied whole at its COMMIT.
    pub(super) early: Option<TxnMeta>,
    /// Orphan checks of the transaction being queued, run before its
    /// progress and commit (`fk.rs`).
    pub(super) fk_pending: Vec<super::fk::FkCheck>,
    /// A connection to the publisher, opened when a conflict first needs
    /// values it did not send.
    pub(super) origin_client: Option<Client>,
    /// The careful path's statements by text (`careful/mod.rs`, `prepared`).
    pub(super) careful_stmts: std::sync::Mutex<HashMap<String, Statement>>,
    /// The careful transaction's writes not answered yet (`deferred.rs`).
    pub(super) deferred: super::deferred::Deferred,
    /// The other apply lanes of this stream (`lanes.rs`); None with one.
    pub(super) lanes: Option<Box<super::lanes::Lanes>>,
    /// The locks of the transaction being queued in a lane (`lanes.rs`).
    pub(super) turn: Option<super::lanes::Turn>,
    /// The gate, taken for this lane by the dispatcher (`lanes.rs`).
    pub(super) gate_ticket: Option<super::gate::Shared>,
    /// Routine changes counted by the other lanes, not yet reported.
    pub(super) routine_side: u64,
    /// A lane transaction's turn, its wait for the one before, the lane's
    /// token taken afresh, and every token let go (`sql::LANE_*`,
    /// `lanes.rs`).
    pub(super) lane_turn: Stmt,
    pub(super) lane_wait: Stmt,
    pub(super) lane_token: Stmt,
    pub(super) lane_release: Stmt,
}

pub(super) fn parse_lsn(s: Option<String>, what: &str) -> Result<Lsn, ApplyFailure> {
    match s {
        None => Ok(Lsn::INVALID),
        Some(s) => s
            .parse()
            .map_err(|e| ApplyFailure::new(None, format!("{what}: {e}"))),
    }
}

impl Applier {
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
            let node =
                crate::stream::names::node_of_origin(&name).map_or(name.clone(), str::to_owned);
            self.origins.insert(id, node);
        }
        let mut peer: Vec<u32> = self
            .origins
            .iter()
            .filter(|(id, n)| **id != 0 && **n == self.ctx.peer)
            .map(|(id, _)| *id)
            .collect();
        peer.sort_unstable();
        self.peer_param = Param::oid_array(&peer);
        self.peer_roidents = peer;
        let (ids, names): (Vec<u32>, Vec<String>) = self
            .origins
            .iter()
            .filter(|(id, _)| **id != 0)
            .map(|(id, n)| (*id, n.clone()))
            .unzip();
        self.origin_params = (Param::oid_array(&ids), Param::text_array(&names));
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
        if let Some(l) = self.lanes.as_mut() {
            for side in &mut l.side {
                side.install_watermark(wm.clone()).await?;
            }
        }
        self.install_watermark(wm).await
    }

    pub(super) async fn install_watermark(
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
        let mut less = Vec::new();
        for (node, t) in &wm {
            for (id, _) in self.origins.iter().filter(|(_, n)| *n == node) {
                ids.push(*id);
                ts.push(PgTimestamp::from_datetime(*t).0);
                less.push(PgTimestamp::from_datetime(*t - crate::watermark::ORDER_MARGIN).0);
            }
        }
        self.wm = Arc::new(Watermark {
            map: wm,
            params: (
                Param::oid_array(&ids),
                Param::timestamptz_array(&ts),
                Param::timestamptz_array(&less),
            ),
        });
        Ok(())
    }

    /// Routine cross-origin changes applied since the last call.
    pub fn take_routine(&mut self) -> u64 {
        self.gather_side_done();
        let total = self.routine_fast + self.routine_careful;
        let n = total.saturating_sub(self.routine_taken);
        self.routine_taken = total;
        n + std::mem::take(&mut self.routine_side)
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

    pub(super) fn guard_params(&self, txn: &TxnMeta) -> Guard {
        Guard {
            peers: self.peer_param.clone(),
            ts: Param::timestamptz(txn.commit_ts.0),
            wm: Arc::clone(&self.wm),
        }
    }

    /// The highest applied remote position whose local commit is flushed to
    /// disk: the only position we may report to the publisher as flushed.
    /// Sampling the local WAL insert position after the last commit and
    /// waiting for the flush position to pass it is the same rule as
    /// PostgreSQL's own get_flush_position, at the granularity of our ticks.
    pub async fn durable_progress(&mut self) -> Result<Lsn, ApplyFailure> {
        self.settle_all().await?;
        let (insert, flush) = self.wal_positions().await?;
        if let Some(l) = self.lanes.as_mut() {
            // Their sessions count their own routine changes.
            for side in &mut l.side {
                side.wal_positions().await?;
            }
        }
        Ok(self.durability.observe(self.last_applied, insert, flush))
    }

    /// The local WAL insert and flush positions, and this session's count of
    /// routine changes (`mm.routine`, a session setting) into `routine_fast`.
    /// The fast path's routine changes are counted on the session it runs
    /// on: the pipelined one when there is one.
    async fn wal_positions(&mut self) -> Result<(Lsn, Lsn), ApplyFailure> {
        let (insert, flush, routine) = match self.pipe.as_mut().filter(|p| p.is_pipelined()) {
            Some(pipe) => {
                let mut rows = pipe.query(WAL_POSITIONS).await?;
                let mut row = rows.pop().unwrap_or_default().into_iter();
                (
                    row.next().flatten(),
                    row.next().flatten(),
                    row.next().flatten(),
                )
            }
            None => {
                let row = self
                    .client
                    .query_one(&self.wal_positions, &[])
                    .await
                    .map_err(|e| ApplyFailure::from_pg(None, &e))?;
                (row.get(0), row.get(1), row.get(2))
            }
        };
        let insert = parse_lsn(insert, "pg_current_wal_insert_lsn")?;
        let flush = parse_lsn(flush, "pg_current_wal_flush_lsn")?;
        if let Some(n) = routine.and_then(|v: String| v.parse::<u64>().ok()) {
            self.routine_fast = n;
        }
        Ok((insert, flush))
    }

    /// Applies a relation description that arrived outside a transaction.
    pub async fn relation(
        &mut self,
        rel: mm_proto::pgoutput::Relation,
    ) -> Result<(), ApplyFailure> {
        // Held transactions are mapped with the description they came under.
        self.close_group().await?;
        self.load_relation(rel).await
    }

    /// A relation description met while applying: never sends a held
    /// group, which must follow every transaction being applied now.
    pub(super) async fn load_relation(
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
        if self.lanes.is_some() {
            // Alone (false): every other lane has drained.
            if self.apply_in_lanes(meta, &body).await? {
                return Ok(());
            }
        } else if self.hold_in_group(meta, &body) {
            return self.close_full_group().await;
        }
        self.close_group().await?;
        self.apply_alone(meta, body).await
    }

    /// `apply`, for a transaction that is its own local transaction.
    pub(super) async fn apply_alone(
        &mut self,
        meta: &TxnMeta,
        body: TxnBody,
    ) -> Result<(), ApplyFailure> {
        self.queued
            .push_back((*meta, Arc::clone(&body), Arc::clone(&self.wm)));
        let hot = match self.streak {
            0 => None,
            _ => self.hot_route(meta, &body),
        };
        if hot == Some(super::recover::HotRoute::Careful) {
            self.streak -= 1;
            return self.apply_hot(meta, &body).await;
        }
        let mut r = self.queue_fast(meta, &body).await;
        // Right after a conflict, more are likely (hot rows): wait for each
        // transaction's reply, so the next conflict rolls back only itself.
        // One that settles its conflict in place stays pipelined: with
        // dense conflicts on many keys, every first conflict of a key would
        // otherwise keep the whole stream one transaction at a time.
        // It still counts towards the streak's end: a stream whose traffic
        // is all hot keys would otherwise stay in the streak for good, and
        // a large transaction is not applied while it arrives during one.
        if r.is_ok() && self.streak > 0 {
            self.streak -= 1;
            if hot.is_none() {
                r = self.settle(0).await;
            }
        }
        match r {
            Err(f) if f.conflict => self.recover(f).await,
            r => r,
        }
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
        if let Some(g) = self.gate_ticket.take() {
            return Ok(g);
        }
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

    /// See `Pipeline::send_queued`.
    pub async fn send_queued(&mut self) -> Result<(), ApplyFailure> {
        match self.pipe.as_mut() {
            Some(p) => p.send_queued().await,
            None => Ok(()),
        }
    }

    /// Waits for the next reply (for an idle stream: keeps results flowing).
    /// A group held stays held (`group.rs`): it grows while the session is
    /// busy answering, and the stream sends it before the session idles.
    pub async fn settle_next(&mut self) -> Result<(), ApplyFailure> {
        if self.lanes.is_some() {
            return self.settle_next_lane().await;
        }
        let keep = self.sent_in_flight().saturating_sub(1);
        self.settle(keep).await
    }

    /// Statements in flight, on every lane.
    /// Statements sent and not answered (a held group aside).
    pub fn sent_in_flight(&self) -> usize {
        self.pipe.as_ref().map_or(0, Pipeline::in_flight) + self.in_flight_lanes()
    }

    /// A group held and not yet sent counts as one: its transactions are
    /// not applied.
    pub fn in_flight(&self) -> usize {
        self.pipe.as_ref().map_or(0, Pipeline::in_flight)
            + self.in_flight_lanes()
            + usize::from(self.group_open())
    }

    /// See `Pipeline::wants_more`; true when nothing is in flight.
    pub fn wants_more(&self) -> bool {
        self.pipe.as_ref().is_none_or(Pipeline::wants_more) && self.side_lanes_want_more()
    }

    pub(super) fn push_done(&mut self, d: Done) {
        if let Some(p) = self.pipe.as_mut() {
            p.done.push_back(d);
        }
    }

    /// Transactions committed since the last call, in commit order.
    pub fn take_done(&mut self) -> Vec<Done> {
        self.gather_side_done();
        let mut done: Vec<Done> = self
            .pipe
            .as_mut()
            .map(|p| p.done.drain(..).collect())
            .unwrap_or_default();
        // Lanes finish in any order; they commit in the publisher's.
        done.sort_by_key(|d| d.meta.end_lsn);
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
        super::hot::relation_of(m)
            .and_then(|oid| self.relations.get(&oid))
            .is_some_and(|r| r.fks.is_some())
    }

    /// How a routine delete from the publisher writes its tombstone: none
    /// while the publisher is this node's only peer
    /// (`sql::TombstoneWrite::Skip`), else as the table's mode says.
    pub(super) fn tombstone_write(&self, rel: &LocalRelation) -> super::sql::TombstoneWrite {
        if self.ctx.applied.sole_peer(&self.ctx.peer) {
            super::sql::TombstoneWrite::Skip
        } else {
            rel.tombstone_write()
        }
    }

    pub(super) fn rel(&self, oid: u32) -> Result<&LocalRelation, ApplyFailure> {
        self.relations.get(&oid).ok_or_else(|| {
            ApplyFailure::new(
                None,
                format!("change for relation oid {oid} arrived before its RELATION message"),
            )
        })
    }

    pub(super) fn rel_mut(&mut self, oid: u32) -> Result<&mut LocalRelation, ApplyFailure> {
        self.relations.get_mut(&oid).ok_or_else(|| {
            ApplyFailure::new(
                None,
                format!("change for relation oid {oid} arrived before its RELATION message"),
            )
        })
    }
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
