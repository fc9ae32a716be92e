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
//! takes an advisory lock of its own first, and before its progress guard
//! it waits for the lock of the transaction before it when that one is in
//! another lane, i.e. until it committed or rolled back. Its guard then
//! finds the previous transaction's end only if that one committed, so
//! transactions commit one after another in the publisher's order across
//! lanes, and a failure rolls back every transaction after it, as on one
//! session. The guard alone decides: a wait that ends too early (a lock
//! not taken yet) fails the guard, never commits out of order. The wait
//! is a lock PostgreSQL sees: if two lanes ever wait for each other (a
//! dependency no fingerprint showed), its deadlock detector ends one of
//! them, and the failure path below applies the rest alone.
//!
//! The lock must exist before the wait starts, for the wait to mean
//! anything. Each lane's session holds a token, a session-level advisory
//! lock for its next position; a transaction takes its own lock, then the
//! token of the position after it, then lets go of its own position's. A
//! transaction in another lane waits for that token (shared), then for the
//! lock. The token exists before the wait when the lane's transaction
//! that took it has committed before the waiter starts: the dispatcher
//! only sends a transaction to another lane when the last transaction
//! queued there ends after that one (commits follow the publisher's order,
//! so the waiter's lane committed it first), or when it is known to have
//! committed (`token_sure`). Otherwise the transaction stays in its
//! predecessor's lane. So single-row transactions alternate between lanes
//! and their row changes run at once; only their commits are serial. A
//! lane's transaction waits at most `LANE_LOCK_TIMEOUT` for any lock: a
//! token held by a lane idle after a failure (its next transaction was
//! skipped) would otherwise never be let go; the failure path lets every
//! lane's tokens go first (`release_tokens`), the timeout is the backstop.
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

use super::applier::Applier;
use super::hot::{fingerprint, key_of};
use super::pipeline::Pipeline;
use super::relation::LocalRelation;
use super::schedule::{Placement, Scheduler};
use super::tuple::locate;
use super::txn::{TxnBody, TxnMeta};
use super::{ApplyFailure, Param};

/// What the transaction sent last waits on, for the one sent next.
#[derive(Debug, Clone, Copy)]
pub(super) enum Pred {
    /// Committed, or queued in `lane` outside the lanes (the
    /// single-session path): a transaction for another lane waits until
    /// that lane settled.
    Unlocked { lane: usize },
    /// Placed in `lane` with lock `key`, after taking the lane's token
    /// `token`, which the transaction `taker` took before it (`None`: at
    /// the token's start, known to be held).
    Locked {
        lane: usize,
        key: (i32, i32),
        token: (i32, i32),
        taker: Option<Lsn>,
    },
}

/// A transaction ready to be sent to a lane (`prepare_dispatch`).
struct Ready {
    lane: usize,
    turn: Turn,
    taker: Option<Lsn>,
    /// The token position the transaction takes.
    next_pos: u32,
    ticket: super::gate::Shared,
}

/// The locks of a transaction applied in a lane (set on the lane's
/// `Applier` while it is queued): its own, its lane's token positions,
/// and what it waits for.
#[derive(Debug, Clone, Copy)]
pub(super) struct Turn {
    pub own: (i32, i32),
    pub token: TokenKeys,
    pub prev: Option<Wait>,
}

/// A lane's token keys for one transaction: their class (first half), the
/// position it lets go of and the one it takes (second halves).
#[derive(Debug, Clone, Copy)]
pub(super) struct TokenKeys {
    pub class: i32,
    pub held: i32,
    pub next: i32,
}

/// The transaction before, in another lane: its lane's token, its lock.
#[derive(Debug, Clone, Copy)]
pub(super) struct Wait {
    pub token: (i32, i32),
    pub lock: (i32, i32),
}

impl Turn {
    /// `sql::lane_turn`'s parameters, also the first of a fused
    /// statement's lane parameters.
    pub fn turn_params(&self) -> [Param; 5] {
        [
            Param::int4(self.own.0),
            Param::int4(self.own.1),
            Param::int4(self.token.class),
            Param::int4(self.token.next),
            Param::int4(self.token.held),
        ]
    }

    /// `sql::LANE_WAIT`'s parameters, when there is one to wait for.
    pub fn wait_params(&self) -> Option<[Param; 4]> {
        self.prev.map(|w| {
            [
                Param::int4(w.token.0),
                Param::int4(w.token.1),
                Param::int4(w.lock.0),
                Param::int4(w.lock.1),
            ]
        })
    }

    /// A fused statement's (`sql::LANE_PARAMS`): the turn's, then the
    /// second halves of what it waits for. With nothing to wait for, it
    /// waits for locks it holds itself, which is granted at once.
    pub fn fused_params(&self) -> Vec<Param> {
        let (token, lock) = match self.prev {
            Some(w) => (w.token.1, w.lock.1),
            None => (self.token.next, self.own.1),
        };
        let mut p = self.turn_params().to_vec();
        p.extend([Param::int4(token), Param::int4(lock)]);
        p
    }
}

/// A lane's token: the position its session holds (`None`: to be taken,
/// at first use and after a failure), the transaction that took it, and
/// the newest transaction sent to the lane.
#[derive(Debug, Clone, Copy, Default)]
struct Token {
    held: Option<u32>,
    taker: Option<Lsn>,
    last_sent: Lsn,
}

/// The second half of a token's key: lane and position.
fn token_key(lane: usize, pos: u32) -> i32 {
    (((lane as u32) << 24) | (pos & 0x00FF_FFFF)) as i32
}

pub(super) struct Lanes {
    /// Lanes 1..: lane k is `side[k - 1]`.
    pub side: Vec<Applier>,
    sched: Scheduler,
    pred: Pred,
    /// First half of every lock key of this stream: keeps streams apart.
    class: i32,
    /// First half of this stream's token keys.
    token_class: i32,
    /// By lane, 0 first.
    tokens: Vec<Token>,
    /// Positions are never reused, not even after a failure.
    next_pos: u32,
    /// Everything up to here committed (`retire_committed`).
    committed: Lsn,
}

impl Lanes {
    pub fn new(peer: &str, side: Vec<Applier>) -> Lanes {
        let class = |what: &str| {
            let mut h = DefaultHasher::new();
            (what, peer).hash(&mut h);
            h.finish() as i32
        };
        Lanes {
            sched: Scheduler::new(side.len() + 1),
            tokens: vec![Token::default(); side.len() + 1],
            side,
            pred: Pred::Unlocked { lane: 0 },
            class: class("mm-lanes"),
            token_class: class("mm-lane-tokens"),
            next_pos: 0,
            committed: Lsn(0),
        }
    }

    /// Whether a transaction sent to `lane` now surely starts after the
    /// token `taker` took exists (module docs).
    fn token_sure(&self, lane: usize, taker: Option<Lsn>) -> bool {
        taker.is_none_or(|t| {
            t <= self.committed || self.tokens.get(lane).is_some_and(|k| k.last_sent >= t)
        })
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
        let sure = |a: &Applier, k: usize, taker: Option<Lsn>| {
            a.lanes.as_ref().is_some_and(|l| l.token_sure(k, taker))
        };
        let lane = match (placed, pred) {
            // Free to go anywhere, behind one still in flight outside the
            // lanes (the single-session path): it stays in that lane, since
            // another lane would first wait for that one's commit reply.
            (Placement::Free(_), Pred::Unlocked { lane: l })
                if self.lane(l).in_flight_here() > 0 =>
            {
                l
            }
            // Likewise behind one whose lane's token another lane cannot be
            // sure of yet (module docs): it waits in the server instead,
            // behind that one on the same session.
            (Placement::Free(k), Pred::Locked { lane: l, taker, .. })
                if k != l && !sure(self, k, taker) =>
            {
                l
            }
            (Placement::Free(k), _) | (Placement::Lane(k), _) => k,
            (Placement::Wait, _) => 0,
        };
        let prev = match pred {
            Pred::Unlocked { lane: l } if l != lane => {
                self.lane(l).settle(0).await?;
                None
            }
            Pred::Unlocked { .. } => None,
            Pred::Locked { lane: l, .. } if l == lane => None,
            Pred::Locked {
                key, token, taker, ..
            } => {
                // Placed there by its keys: it waits until the token is sure.
                while !sure(self, lane, taker) {
                    if self.in_flight_here() + self.in_flight_lanes() == 0 {
                        break;
                    }
                    self.settle_next_lane().await?;
                    self.retire_committed();
                }
                Some(Wait { token, lock: key })
            }
        };
        let (token, taker, next_pos) = self.ensure_token(lane, meta).await?;
        let ticket = self.gate_for_lanes().await?;
        self.sync_relations(lane, body).await?;
        Ok(Ready {
            lane,
            turn: Turn { own, token, prev },
            taker,
            next_pos,
            ticket,
        })
    }

    /// The token positions a transaction sent to `lane` moves (class, the
    /// one held, the next), and the transaction that took the one held.
    /// A lane without a token takes one first, and waits for the reply:
    /// a token nobody took yet is only sure once it is known to be held.
    async fn ensure_token(
        &mut self,
        lane: usize,
        meta: &TxnMeta,
    ) -> Result<(TokenKeys, Option<Lsn>, u32), ApplyFailure> {
        let Some(l) = self.lanes.as_mut() else {
            return Err(ApplyFailure::new(None, "apply lanes vanished"));
        };
        let class = l.token_class;
        let held = l.tokens.get(lane).and_then(|t| t.held);
        let pos = match held {
            Some(p) => p,
            None => {
                let p = l.next_pos;
                l.next_pos = p.wrapping_add(1);
                let a = self.lane(lane);
                a.settle(0).await?;
                let stmt = a.lane_token.clone();
                let params = vec![Param::int4(class), Param::int4(token_key(lane, p))];
                if let Some(pipe) = a.pipe.as_mut() {
                    let op = super::fast::control_op(super::pipeline::OpKind::Control, *meta);
                    pipe.push(&stmt, params, op).await?;
                    pipe.settle(0).await?;
                }
                p
            }
        };
        let Some(l) = self.lanes.as_mut() else {
            return Err(ApplyFailure::new(None, "apply lanes vanished"));
        };
        let next = l.next_pos;
        l.next_pos = next.wrapping_add(1);
        let t = &mut l.tokens[lane];
        if held.is_none() {
            t.taker = None;
        }
        t.held = Some(pos);
        let keys = TokenKeys {
            class,
            held: token_key(lane, pos),
            next: token_key(lane, next),
        };
        Ok((keys, t.taker, next))
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
        let Ready {
            lane,
            turn,
            taker,
            next_pos,
            ticket,
        } = ready;
        // Lane 0's view of the publisher is the one in effect.
        let wm = Arc::clone(&self.wm);
        let expected = self.next_expected;
        let target = self.lane(lane);
        target.wm = Arc::clone(&wm);
        target.next_expected = expected;
        target.turn = Some(turn);
        target.gate_ticket = Some(ticket);
        target.queued.push_back((*meta, Arc::clone(body), wm));
        let r = target.queue_fast(meta, body).await;
        target.turn = None;
        target.gate_ticket = None;
        r?;
        self.next_expected = meta.end_lsn;
        if let Some(l) = self.lanes.as_mut() {
            let t = &mut l.tokens[lane];
            t.held = Some(next_pos);
            t.taker = Some(meta.end_lsn);
            t.last_sent = meta.end_lsn;
            l.pred = Pred::Locked {
                lane,
                key: turn.own,
                token: (turn.token.class, turn.token.held),
                taker,
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
            self.lane(lane).load_relation(remote).await?;
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
            l.committed = l.committed.max(end);
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
    ///
    /// Reads whichever lane answers first, lane 0 included, not one lane
    /// after another: a lane may wait in the server for a token of a lane
    /// that failed and is idle, and only reading that failure lets go of
    /// it (`lanes_failure`).
    pub(super) async fn settle_side_lanes(&mut self) -> Result<(), ApplyFailure> {
        if self.lanes.is_none() {
            return Ok(());
        }
        while self.in_flight_lanes() > 0 {
            self.settle_next_lane().await?;
        }
        self.gather_side_done();
        Ok(())
    }

    /// Every lane lets go of its tokens, whatever failed before on it
    /// (module docs), and takes a fresh one at its next use.
    async fn release_tokens(&mut self) {
        let Some(l) = self.lanes.as_mut() else {
            return;
        };
        for t in &mut l.tokens {
            t.held = None;
        }
        l.pred = Pred::Unlocked { lane: 0 };
        for a in &mut l.side {
            a.release_own_tokens().await;
        }
        self.release_own_tokens().await;
    }

    async fn release_own_tokens(&mut self) {
        let stmt = self.lane_release.clone();
        let op = super::fast::control_op(super::pipeline::OpKind::Control, TxnMeta::streaming(0));
        if let Some(p) = self.pipe.as_mut()
            && let Err(e) = p.push_after_failure(&stmt, op).await
        {
            tracing::debug!(error = %e, "apply lane: letting go of its tokens");
        }
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
        self.release_tokens().await;
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
        // applied alone, the transactions cannot meet it again. A lock
        // waited for longer than a lane may (`LANE_LOCK_TIMEOUT`) is
        // waited for there without a limit.
        if matches!(first.sqlstate.as_deref(), Some("40P01" | "55P03")) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(prev: Option<Wait>) -> Turn {
        Turn {
            own: (7, 100),
            token: TokenKeys {
                class: 9,
                held: token_key(1, 4),
                next: token_key(1, 5),
            },
            prev,
        }
    }

    #[test]
    fn a_fused_statement_gets_the_turn_then_what_it_waits_for() {
        let dbg = |p: &[Param]| format!("{p:?}");
        let t = turn(Some(Wait {
            token: (9, token_key(0, 3)),
            lock: (7, 99),
        }));
        let fused = t.fused_params();
        assert_eq!(fused.len(), super::super::sql::LANE_PARAMS);
        assert_eq!(dbg(&fused[..5]), dbg(&t.turn_params()));
        assert_eq!(
            dbg(&fused[5..]),
            dbg(&[Param::int4(token_key(0, 3)), Param::int4(99)])
        );
        // Nothing to wait for: its own token and lock, granted at once.
        let alone = turn(None).fused_params();
        assert_eq!(
            dbg(&alone[5..]),
            dbg(&[Param::int4(token_key(1, 5)), Param::int4(100)])
        );
    }

    #[test]
    fn token_keys_keep_lanes_apart_and_wrap_positions() {
        assert_ne!(token_key(0, 1), token_key(1, 1));
        assert_eq!(token_key(2, 1 << 24), token_key(2, 0));
    }
}
