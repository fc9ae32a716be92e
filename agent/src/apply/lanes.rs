//! Parallel apply lanes (`replication.apply_lanes`): several apply sessions
//! per stream, transactions placed by their write set (`schedule.rs`),
//! committed in the publisher's order.
//!
//! Lane 0 is the `Applier` itself; lanes 1.. are `Applier`s of their own
//! (session, prepared statements, pipeline, replication origin: PostgreSQL
//! 18 binds an origin to one session, so lane k binds `mm_<peer>#k`, which
//! every origin lookup maps back to the peer, `stream/names.rs`). All
//! lanes record progress in the peer's one `mm.apply_progress` row.
//!
//! Invariant (commit order, exactly-once): a transaction placed in a lane
//! takes an advisory lock of its own right after BEGIN, and before its
//! progress guard it waits for the lock of the transaction before it when
//! that one is in another lane, i.e. until it committed or rolled back.
//! Its guard then finds the previous transaction's end only if that one
//! committed, so transactions commit one after another in the publisher's
//! order across lanes, and a failure rolls back every transaction after it,
//! as on one session. The wait is a lock PostgreSQL sees: if two lanes ever
//! wait for each other (a dependency no fingerprint showed), its deadlock
//! detector ends one of them, and the failure path below applies the rest
//! alone. The lock must exist before the wait starts, so a transaction is
//! only sent to a lane once the reply to its predecessor's lock has been
//! read (`Pred::Locked`); every statement of a transaction is then sent at
//! once, and no lane ever waits for the agent.
//!
//! Everything the scheduler cannot place safely (tables with triggers that
//! fire on apply or in foreign keys, truncates, relation changes, messages,
//! transactions too large for memory, skips, the conflict streak, large
//! transactions applied while they arrive) is applied by lane 0 alone,
//! after every other lane drained: the single-session path as it was. A
//! failure in any lane drains them all, and lane 0 applies every
//! uncommitted transaction again in order (`recover`).

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;

use futures_util::future::select_all;
use mm_proto::Lsn;
use mm_proto::pgoutput::Message;

use super::applier::{Applier, TxnBody, TxnMeta};
use super::hot::{fingerprint, key_of};
use super::pipeline::Pipeline;
use super::relation::LocalRelation;
use super::schedule::{Placement, Scheduler};
use super::tuple::locate;
use super::{ApplyFailure, Param};

/// What the transaction sent last waits on, for the one sent next.
#[derive(Debug, Clone, Copy)]
pub(super) enum Pred {
    /// Committed, or queued in `lane` without a lock (the single-session
    /// path, or one statement that is its whole transaction): a transaction
    /// for another lane waits until that lane settled.
    Unlocked { lane: usize },
    /// Placed in `lane` with lock `key`, taken by statement `op` there.
    Locked {
        lane: usize,
        key: (i32, i32),
        op: u64,
    },
}

/// A transaction ready to be sent to a lane (`prepare_dispatch`).
struct Ready {
    lane: usize,
    turn: Turn,
    ticket: super::gate::Shared,
}

/// The lock a transaction applied in a lane takes, and the one before it
/// that it waits for (set on the lane's `Applier` while it is queued). A
/// transaction that is one statement (`sql::Commit::Fused`) takes none: it
/// waits for the one before in a statement of its own, and the next one
/// goes to another lane only after it committed (`Pred::Unlocked`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Turn {
    pub own: (i32, i32),
    pub prev: Option<(i32, i32)>,
}

pub(super) struct Lanes {
    /// Lanes 1..: lane k is `side[k - 1]`.
    pub side: Vec<Applier>,
    sched: Scheduler,
    pred: Pred,
    /// First half of every lock key of this stream: keeps streams apart.
    class: i32,
}

impl Lanes {
    pub fn new(peer: &str, side: Vec<Applier>) -> Lanes {
        let mut h = DefaultHasher::new();
        ("mm-lanes", peer).hash(&mut h);
        Lanes {
            sched: Scheduler::new(side.len() + 1),
            side,
            pred: Pred::Unlocked { lane: 0 },
            class: h.finish() as i32,
        }
    }

    fn key(&self, meta: &TxnMeta) -> (i32, i32) {
        (self.class, meta.end_lsn.0 as i32)
    }
}

impl Applier {
    fn lane(&mut self, k: usize) -> &mut Applier {
        match k {
            0 => self,
            k => &mut self.lanes.as_mut().expect("lanes").side[k - 1],
        }
    }

    /// The write set of a transaction lanes may apply in parallel, `None`
    /// when it must be applied alone (module docs).
    fn write_set(&self, meta: &TxnMeta, body: &TxnBody) -> Option<Vec<u64>> {
        if self.streak > 0 || self.early.is_some() || self.skips.contains(&meta.commit_lsn) {
            return None;
        }
        let msgs = body.messages()?;
        let mut keys = Vec::new();
        for m in msgs.iter() {
            match m {
                Message::Insert(i) => {
                    let rel = self.lane_rel(i.relation_oid)?;
                    keys.push(key_of(rel, m)?);
                    unique_keys(rel, &i.new, &mut keys)?;
                }
                Message::Update(u) => {
                    let rel = self.lane_rel(u.relation_oid)?;
                    frees_nothing_unknown(rel)?;
                    keys.push(key_of(rel, m)?);
                    let (mask, new_key) = locate(rel, None, Some(&u.new)).ok()?;
                    if !mask.is_empty() {
                        return None;
                    }
                    keys.push(fingerprint(u.relation_oid, &new_key));
                    unique_keys(rel, &u.new, &mut keys)?;
                }
                Message::Delete(d) => {
                    let rel = self.lane_rel(d.relation_oid)?;
                    frees_nothing_unknown(rel)?;
                    keys.push(key_of(rel, m)?);
                }
                Message::Type(_) | Message::Origin(_) => {}
                _ => return None,
            }
        }
        keys.sort_unstable();
        keys.dedup();
        Some(keys)
    }

    fn lane_rel(&self, oid: u32) -> Option<&LocalRelation> {
        self.relations
            .get(&oid)
            .filter(|r| r.lanes_safe && r.fks.is_none())
    }

    /// Applies `meta` in a lane when it may run in parallel: Ok(true). Ok(false):
    /// it must be applied alone, and every other lane has drained.
    ///
    /// A failure met before `meta` is queued (while waiting for a lane, a
    /// lock or the gate) is recovered here and `meta` is then applied alone;
    /// one met after is recovered with `meta` among the transactions lane 0
    /// applies again. Either way `meta` is applied exactly once.
    pub(super) async fn apply_in_lanes(
        &mut self,
        meta: &TxnMeta,
        body: &TxnBody,
    ) -> Result<bool, ApplyFailure> {
        let Some(keys) = self.write_set(meta, body) else {
            if let Err(f) = self.settle_side_lanes().await {
                self.lanes_failure(f).await?;
            }
            if let Some(l) = self.lanes.as_mut() {
                l.pred = Pred::Unlocked { lane: 0 };
            }
            return Ok(false);
        };
        let ready = match self.prepare_dispatch(meta, body, &keys).await {
            Ok(r) => r,
            Err(f) => {
                self.lanes_failure(f).await?;
                return Ok(false);
            }
        };
        if let Err(f) = self.dispatch(meta, body, keys, ready).await {
            self.lanes_failure(f).await?;
        }
        Ok(true)
    }

    /// Everything `meta` waits for before it is sent: a lane, the lock of
    /// the transaction before it, the gate, the lane's relations.
    async fn prepare_dispatch(
        &mut self,
        meta: &TxnMeta,
        body: &TxnBody,
        keys: &[u64],
    ) -> Result<Ready, ApplyFailure> {
        let placed = loop {
            self.retire_committed();
            let placement = self.lanes.as_ref().map(|l| l.sched.place(keys));
            match placement {
                Some(Placement::Wait) => self.settle_next_lane().await?,
                Some(p) => break p,
                None => return Err(ApplyFailure::new(None, "apply lanes vanished")),
            }
        };
        let (own, pred) = match self.lanes.as_ref() {
            Some(l) => (l.key(meta), l.pred),
            None => return Err(ApplyFailure::new(None, "apply lanes vanished")),
        };
        let lane = match (placed, pred) {
            (Placement::Lane(k), _) => k,
            // Free to go anywhere, behind one that holds no lock and is
            // still in flight (a one-statement transaction, the
            // single-session path): it stays in that lane, since another
            // lane would first wait for that one's commit reply. A run of
            // single-row transactions thus stays pipelined on one session
            // (measured: 50k single-row INSERTs at 26.0k rows/s with 2
            // lanes against 23.9k with one; moving on instead, 5.4k).
            (Placement::Free(_), Pred::Unlocked { lane: l })
                if self.lane(l).in_flight_here() > 0 =>
            {
                l
            }
            // Likewise behind one whose lock has not been answered yet:
            // another lane would first wait for that reply, a round trip
            // through everything queued ahead of it there. Moving on
            // regardless serialized small multi-statement transactions on
            // those replies (`mm-bench backlog updins`, 2 lanes: 11.4k
            // rows/s against 31.5k with one).
            (Placement::Free(_), Pred::Locked { lane: l, op, .. })
                if !self.lock_answered(l, op) =>
            {
                l
            }
            (Placement::Free(k), _) => k,
            (Placement::Wait, _) => 0,
        };
        let prev = match pred {
            Pred::Unlocked { lane: l } if l != lane => {
                self.lane(l).settle(0).await?;
                None
            }
            Pred::Unlocked { .. } => None,
            Pred::Locked { lane: l, .. } if l == lane => None,
            Pred::Locked { lane: l, key, op } => {
                while !self.lock_answered(l, op) {
                    self.settle_next_lane().await?;
                }
                Some(key)
            }
        };
        let ticket = self.gate_for_lanes().await?;
        self.sync_relations(lane, body).await?;
        Ok(Ready {
            lane,
            turn: Turn { own, prev },
            ticket,
        })
    }

    /// Sends `meta` whole to its lane: it is in that lane's queue from
    /// here on, so a failure now is recovered with it.
    async fn dispatch(
        &mut self,
        meta: &TxnMeta,
        body: &TxnBody,
        keys: Vec<u64>,
        ready: Ready,
    ) -> Result<(), ApplyFailure> {
        let Ready { lane, turn, ticket } = ready;
        // Lane 0's view of the publisher is the one in effect.
        let wm = Arc::clone(&self.wm);
        let expected = self.next_expected;
        let target = self.lane(lane);
        target.wm = Arc::clone(&wm);
        target.next_expected = expected;
        target.turn = Some(turn);
        target.gate_ticket = Some(ticket);
        target.queued.push_back((*meta, Arc::clone(body), wm));
        target.turn_fused = false;
        let r = target.queue_fast(meta, body).await;
        target.turn = None;
        target.gate_ticket = None;
        let (op, fused) = (target.turn_op, target.turn_fused);
        r?;
        self.next_expected = meta.end_lsn;
        if let Some(l) = self.lanes.as_mut() {
            l.pred = if fused {
                Pred::Unlocked { lane }
            } else {
                Pred::Locked {
                    lane,
                    key: turn.own,
                    op,
                }
            };
            l.sched.assign(lane, meta.end_lsn, keys);
        }
        Ok(())
    }

    /// The gate (`gate.rs`), shared, for the transaction about to be sent.
    /// When a careful transaction waits for it, every lane first lets go
    /// of the shares its queued transactions hold (all of them commit): a
    /// lane waiting alone would wait for the others' shares, held until
    /// someone reads their commits, which nobody would while it waits.
    async fn gate_for_lanes(&mut self) -> Result<super::gate::Shared, ApplyFailure> {
        if let Some(g) = self.ctx.gate.try_shared() {
            return Ok(g);
        }
        self.settle_side_lanes().await?;
        self.settle(0).await?;
        if !self.txn_open
            && let Some(p) = self.pipe.as_mut()
        {
            p.release_all();
        }
        if let Some(l) = self.lanes.as_mut() {
            for s in &mut l.side {
                if let Some(p) = s.pipe.as_mut() {
                    p.release_all();
                }
            }
            l.pred = Pred::Unlocked { lane: 0 };
        }
        Ok(self.ctx.gate.shared().await)
    }

    /// A side lane learns every relation of `body` the way lane 0 has it
    /// (a RELATION message reaches lane 0 only).
    async fn sync_relations(&mut self, lane: usize, body: &TxnBody) -> Result<(), ApplyFailure> {
        if lane == 0 {
            return Ok(());
        }
        let Some(msgs) = body.messages() else {
            return Ok(());
        };
        for m in msgs.iter() {
            let Some(oid) = super::hot::relation_of(m) else {
                continue;
            };
            let Some(remote) = self.relations.get(&oid).map(|r| &r.remote) else {
                continue;
            };
            let side = &self.lanes.as_ref().expect("lanes").side[lane - 1];
            if side
                .relations
                .get(&oid)
                .is_some_and(|r| r.remote == *remote)
            {
                continue;
            }
            let remote = remote.clone();
            self.lane(lane).relation(remote).await?;
        }
        Ok(())
    }

    /// The newest end every lane knows committed: with commits in the
    /// publisher's order, everything up to it has committed.
    fn retire_committed(&mut self) {
        let mut end = committed_end(self.pipe.as_ref(), self.last_applied);
        if let Some(l) = self.lanes.as_mut() {
            for s in &l.side {
                end = end.max(committed_end(s.pipe.as_ref(), s.last_applied));
            }
            l.sched.retire(end);
        }
    }

    /// Waits for the next reply on any lane. Cancel-safe: only pipelines
    /// are borrowed, each in place.
    pub(super) async fn settle_next_lane(&mut self) -> Result<(), ApplyFailure> {
        let mut futs = Vec::new();
        if let Some(p) = self.pipe.as_mut().filter(|p| p.in_flight() > 0) {
            futs.push(Box::pin(settle_one(p)));
        }
        if let Some(l) = self.lanes.as_mut() {
            for s in &mut l.side {
                if let Some(p) = s.pipe.as_mut().filter(|p| p.in_flight() > 0) {
                    futs.push(Box::pin(settle_one(p)));
                }
            }
        }
        if futs.is_empty() {
            return Ok(());
        }
        let (r, _, _) = select_all(futs).await;
        r
    }

    /// Nothing is in flight on any lane.
    pub(super) fn lanes_settled(&mut self) {
        if let Some(l) = self.lanes.as_mut() {
            l.pred = Pred::Unlocked { lane: 0 };
        }
    }

    /// Whether lane `l` has read the reply to statement `op` (the lock a
    /// transaction takes there): only then may another lane wait for it.
    fn lock_answered(&mut self, l: usize, op: u64) -> bool {
        self.lane(l).pipe.as_ref().is_none_or(|p| p.answered(op))
    }

    /// Statements in flight on this session alone.
    pub(super) fn in_flight_here(&self) -> usize {
        self.pipe.as_ref().map_or(0, Pipeline::in_flight)
    }

    /// Statements in flight on every lane.
    pub(super) fn in_flight_lanes(&self) -> usize {
        self.lanes.as_ref().map_or(0, |l| {
            l.side
                .iter()
                .map(|s| s.pipe.as_ref().map_or(0, Pipeline::in_flight))
                .sum()
        })
    }

    /// Whether every side lane has room for more.
    pub(super) fn side_lanes_want_more(&self) -> bool {
        self.lanes.as_ref().is_none_or(|l| {
            l.side
                .iter()
                .all(|s| s.pipe.as_ref().is_none_or(Pipeline::wants_more))
        })
    }

    /// Waits until nothing is in flight on lanes 1..; their committed
    /// transactions are lane 0's to report.
    pub(super) async fn settle_side_lanes(&mut self) -> Result<(), ApplyFailure> {
        let Some(l) = self.lanes.as_mut() else {
            return Ok(());
        };
        for s in &mut l.side {
            s.settle(0).await?;
        }
        self.gather_side_done();
        Ok(())
    }

    /// Moves the side lanes' finished transactions to lane 0's list.
    pub(super) fn gather_side_done(&mut self) {
        let Some(l) = self.lanes.as_mut() else {
            return;
        };
        let mut done = Vec::new();
        let mut routine = 0;
        for s in &mut l.side {
            done.extend(s.take_done());
            routine += s.take_routine();
        }
        self.routine_side += routine;
        for d in done {
            self.last_applied = self.last_applied.max(d.meta.end_lsn);
            self.push_done(d);
        }
    }

    /// A failure on any lane: waits every lane out, finds the transaction
    /// that failed first (the ones after it failed in their progress guard
    /// or rolled back with it), and hands every uncommitted transaction to
    /// lane 0, which applies them again one by one in order (`recover`).
    pub(super) async fn lanes_failure(&mut self, f: ApplyFailure) -> Result<(), ApplyFailure> {
        let mut first = f;
        if let Some(l) = self.lanes.as_mut() {
            for s in &mut l.side {
                if !s.pipe.as_ref().is_some_and(Pipeline::failed)
                    && let Err(e) = s.settle(0).await
                {
                    earlier(e, &mut first);
                }
            }
        }
        if !self.pipe.as_ref().is_some_and(Pipeline::failed)
            && let Err(e) = self.settle(0).await
        {
            earlier(e, &mut first);
        }
        tracing::debug!(first = %first, txn = ?first.txn.map(|t| t.end_lsn), last_applied = %self.last_applied, "lanes failure");
        self.gather_side_done();
        let mut again = Vec::new();
        if let Some(l) = self.lanes.as_mut() {
            for s in &mut l.side {
                again.extend(s.roll_back_pipeline().await?);
            }
            l.sched.clear();
            l.pred = Pred::Unlocked { lane: 0 };
        }
        self.queued.extend(again);
        self.queued
            .make_contiguous()
            .sort_by_key(|(m, _, _)| m.end_lsn);
        // A deadlock between lanes is a dependency no fingerprint showed:
        // applied alone, the transactions cannot meet it again.
        if first.sqlstate.as_deref() == Some("40P01") {
            first.conflict = true;
        }
        self.resolve_failure_alone(first).await
    }
}

/// Keeps the failure of the earlier transaction.
fn earlier(e: ApplyFailure, first: &mut ApplyFailure) {
    let end = |x: &ApplyFailure| x.txn.map_or(Lsn(u64::MAX), |t| t.end_lsn);
    if end(&e) < end(first) {
        *first = e;
    }
}

async fn settle_one(p: &mut Pipeline) -> Result<(), ApplyFailure> {
    let keep = p.in_flight().saturating_sub(1);
    p.settle(keep).await
}

fn committed_end(pipe: Option<&Pipeline>, applied: Lsn) -> Lsn {
    pipe.and_then(|p| p.done.back())
        .map_or(applied, |d| d.meta.end_lsn.max(applied))
}

/// An update or delete may free a unique value of the old row, which the
/// publisher sends only for the key: a later transaction taking that value
/// would share no fingerprint with it. `None` (applied alone) for a table
/// with a unique index besides its key.
fn frees_nothing_unknown(rel: &LocalRelation) -> Option<()> {
    rel.unique_indexes
        .iter()
        .all(|ix| *ix == rel.key_remote)
        .then_some(())
}

/// Fingerprints of every unique-index value of a row as written; `None`
/// when a value is not sent (unchanged TOAST).
fn unique_keys(
    rel: &LocalRelation,
    row: &mm_proto::pgoutput::TupleData,
    keys: &mut Vec<u64>,
) -> Option<()> {
    use mm_proto::pgoutput::ColumnValue;
    for (n, idx) in rel.unique_indexes.iter().enumerate() {
        let mut vals = Vec::with_capacity(idx.len() + 1);
        vals.push(Param::text(format!("unique {n}")));
        for &c in idx {
            vals.push(match row.columns.get(c)? {
                ColumnValue::Null => Param::Null,
                ColumnValue::Text(b) => Param::Text(b.clone()),
                _ => return None,
            });
        }
        keys.push(fingerprint(rel.remote.oid, &vals));
    }
    Some(())
}
