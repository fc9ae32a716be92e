//! Recovery from a conflict met on the fast path, and the route of
//! transactions on keys that just conflicted.
//!
//! Invariant (commit order, exactly-once): whatever route a transaction
//! takes here, the same transactions commit, in the publisher's order, each
//! once; the progress guard of every statement sent still expects the end
//! of the transaction committed before it.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use mm_proto::Lsn;
use mm_proto::pgoutput::{Message, Update};

use super::applier::{Applier, Watermark};
use super::relation::UPSERT_TOMBSTONES_FOR;
use super::txn::{TxnBody, TxnMeta};
use super::{ApplyFailure, Signal};
use crate::conflict::ResolverChoice;

/// How `recover` applies a rolled-back transaction again, unless it stays
/// pipelined (it settles its conflict in place).
enum Redo {
    Careful { rolled_back: bool },
    OneAtATime,
}

/// The route of a single-change transaction on a key that just conflicted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum HotRoute {
    /// The careful path directly: a fast attempt would be rolled back.
    Careful,
    /// The fast path, pipelined, with the conflict settled in the statement
    /// (`sql::fast_update_in_place`).
    InPlace,
}

/// Transactions applied one at a time after a conflict (see `apply`).
pub(super) const CONFLICT_STREAK: u32 = 64;

impl Applier {
    /// How a transaction whose only change touches a key that just
    /// conflicted is applied; `None` when it is not one.
    pub(super) fn hot_route(&self, meta: &TxnMeta, body: &TxnBody) -> Option<HotRoute> {
        if self.skips.contains(&meta.commit_lsn) {
            return None;
        }
        let change = body.single_change()?;
        let rel = self.relations.get(&super::hot::relation_of(&change)?)?;
        if !self.hot.contains(super::hot::key_of(rel, &change)?) {
            return None;
        }
        Some(match &change {
            Message::Update(u) if self.resolves_in_place(meta, u) => HotRoute::InPlace,
            _ => HotRoute::Careful,
        })
    }

    /// Whether a conflict of `upd` would be settled in its own statement
    /// when its key is hot (`hot::resolvable_in_place`, for a table whose
    /// resolver is last-writer-wins).
    pub(super) fn resolves_in_place(&self, meta: &TxnMeta, upd: &Update) -> bool {
        self.relations.get(&upd.relation_oid).is_some_and(|rel| {
            super::hot::resolvable_in_place(rel, upd, meta.commit_known())
                && matches!(self.ctx.resolvers.for_table(&rel.display),
                    ResolverChoice::Rust(r) if r.is_last_writer_wins())
        })
    }

    /// A transaction on a hot key: the careful path directly, once
    /// everything queued before it has committed (commit order). A conflict
    /// among those is recovered as any other, this transaction with them.
    pub(super) async fn apply_hot(
        &mut self,
        meta: &TxnMeta,
        body: &TxnBody,
    ) -> Result<(), ApplyFailure> {
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

    /// A plain tombstone INSERT of `display`'s deletes met a key that had
    /// one: its keys are deleted again within the purge window, and every
    /// such meeting rolls back what is in flight, so its deletes upsert
    /// for `UPSERT_TOMBSTONES_FOR` (every table's, when the error did not
    /// name one).
    fn upsert_tombstones(&mut self, display: Option<&str>) {
        let until = Instant::now() + UPSERT_TOMBSTONES_FOR;
        for rel in self.relations.values_mut() {
            if display.is_none_or(|d| *rel.display == *d) {
                tracing::debug!(relation = %rel.display, "a deleted key had a tombstone: deletes upsert theirs for a while");
                rel.upsert_tombstones_until = Some(until);
            }
        }
    }

    /// A fast-path statement met a conflict in a queued transaction: every
    /// transaction from that one on rolls back (the progress guard makes the
    /// later ones fail). Waits them out, applies the conflicting one with
    /// the resolver (one statement at a time), and queues the rest again.
    /// Invariant (commit order, exactly-once): the same transactions commit,
    /// in the same order, each once.
    pub async fn recover(&mut self, failure: ApplyFailure) -> Result<(), ApplyFailure> {
        debug_assert!(failure.conflict);
        if failure.signal == Some(Signal::TombstoneTaken) {
            self.upsert_tombstones(failure.relation.as_deref());
        }
        // A group held, not sent, follows every transaction recovered here
        // (commit order): set aside, not sent before them.
        let held = std::mem::take(&mut self.group);
        let mut pending = self.roll_back_pipeline().await?;
        if let Some(t) = failure.txn
            && pending
                .front()
                .is_some_and(|(m, _, _)| m.end_lsn != t.end_lsn)
        {
            tracing::debug!(failed = %t.commit_lsn, "conflict reported behind the first uncommitted transaction");
        }
        let latest = Arc::clone(&self.wm);
        // The one that met the conflict goes careful; the others are applied
        // one at a time: with conflicts dense, queuing them all again would
        // roll them all back again at the next one. Those on a key that just
        // conflicted go to the careful path without a fast attempt, or stay
        // pipelined when they settle their conflict in place (`hot.rs`).
        // Those before it rolled back with it only because they shared its
        // local transaction (`group.rs`): one at a time, fast.
        // Any conflict met on the way rolls back everything uncommitted
        // again; the one that met it goes careful.
        // After a streak of them without a conflict, the rest is grouped
        // again (`group.rs`): a backlog rolled back behind one conflict
        // (up to the pipeline's window of groups) is not applied one round
        // trip per transaction.
        let mut careful_at = met_conflict(&pending, failure.txn);
        let mut calm = 0;
        loop {
            while let Some((m, b, w)) = pending.pop_front() {
                self.wm = Arc::clone(&w);
                if careful_at.is_none()
                    && calm >= CONFLICT_STREAK
                    && self.hot_route(&m, &b).is_none()
                    && self.may_hold(&m, &b)
                {
                    self.close_full_group().await?;
                    continue;
                }
                // What is held goes first: commit order.
                self.close_group().await?;
                self.queued.push_back((m, Arc::clone(&b), w));
                let route = match careful_at {
                    Some(at) if at == m.end_lsn => {
                        careful_at = None;
                        Some(Redo::Careful { rolled_back: true })
                    }
                    Some(_) => Some(Redo::OneAtATime),
                    None => match self.hot_route(&m, &b) {
                        Some(HotRoute::Careful) => Some(Redo::Careful { rolled_back: false }),
                        Some(HotRoute::InPlace) => None,
                        None => Some(Redo::OneAtATime),
                    },
                };
                let r = match route {
                    // Pipelined: settled with the next one that is not.
                    None => self.queue_fast(&m, &b).await,
                    Some(Redo::OneAtATime) => match self.queue_fast(&m, &b).await {
                        Ok(()) => self.settle(0).await,
                        Err(f) => Err(f),
                    },
                    Some(Redo::Careful { rolled_back }) => match self.settle(0).await {
                        Ok(()) => {
                            // Only this transaction is queued uncommitted.
                            let again = self.roll_back_pipeline().await?;
                            self.queued.extend(again);
                            self.apply_careful(&m, &b, rolled_back).await?;
                            self.next_expected = m.end_lsn;
                            Ok(())
                        }
                        Err(f) => Err(f),
                    },
                };
                match r {
                    Ok(()) if careful_at.is_none() => calm += 1,
                    Ok(()) => {}
                    Err(f) if f.conflict => {
                        let mut again = self.roll_back_pipeline().await?;
                        again.extend(pending);
                        pending = again;
                        careful_at = met_conflict(&pending, f.txn);
                        calm = 0;
                    }
                    Err(f) => return Err(f),
                }
            }
            self.close_group().await?;
            match self.settle(0).await {
                Ok(()) => break,
                Err(f) if f.conflict => {
                    pending = self.roll_back_pipeline().await?;
                    careful_at = met_conflict(&pending, f.txn);
                    calm = 0;
                }
                Err(f) => return Err(f),
            }
        }
        self.wm = latest;
        self.streak = CONFLICT_STREAK;
        self.group = held;
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
        // The pipelined session rolled back in `drain` already.
        if std::mem::take(&mut self.txn_open)
            && !self.pipe.as_ref().is_some_and(|p| p.is_pipelined())
        {
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

    /// Waits until everything queued is answered; conflicts met on the way
    /// are resolved (which queues transactions again, hence the loop).
    pub(super) async fn settle_all(&mut self) -> Result<(), ApplyFailure> {
        // Everything queued means the transactions held in a group too.
        self.close_group().await?;
        if self.lanes.is_some() {
            let r = match self.settle_side_lanes().await {
                Ok(()) => self.settle(0).await,
                Err(f) => Err(f),
            };
            if let Err(f) = r {
                self.lanes_failure(f).await?;
            }
            self.gather_side_done();
            // Everything committed; what lane 0 queues next (a large
            // transaction applied while it arrives) holds no lock.
            self.lanes_settled();
            return Ok(());
        }
        // A failure here is resolved as one met while waiting for replies
        // in the stream loop (`resolve_failure`): a conflict is recovered,
        // and a streamed transaction applied before its commit is rolled
        // back to be applied whole at its COMMIT, where its failure names
        // its commit LSN. Feedback ticks and watermarks settle here, and
        // with one Sync per batch they often meet a failure first.
        loop {
            match self.settle(0).await {
                Err(f) => self.resolve_failure_alone(f).await?,
                Ok(()) => return Ok(()),
            }
        }
    }
}

/// The end of the rolled-back transaction that met a conflict: the one the
/// failure names when it is among them, else the first (a failure may be
/// reported behind the transaction that caused it).
fn met_conflict(
    pending: &VecDeque<(TxnMeta, TxnBody, Arc<Watermark>)>,
    failed: Option<TxnMeta>,
) -> Option<Lsn> {
    failed
        .map(|t| t.end_lsn)
        .filter(|e| pending.iter().any(|(m, _, _)| m.end_lsn == *e))
        .or_else(|| pending.front().map(|(m, _, _)| m.end_lsn))
}
