//! Applying a large transaction while it still arrives.
//!
//! The publisher sends an ordinary (not streamed) transaction whole, after
//! it committed there. Applied only at its COMMIT, receiving it and
//! applying it take turns: the walsender and the apply backend each wait
//! for the other, and a 200k-row transaction took twice native's time
//! (native's worker applies each change as it arrives). pgoutput's BEGIN
//! carries the commit LSN and timestamp, all the fast path's statements
//! need; only the progress record needs the end LSN, which comes with
//! COMMIT. So once a transaction is big enough (the stream decides,
//! `stream::OpenTxn`), its changes are queued in parts as they arrive,
//! into one open local transaction.
//!
//! A transaction the publisher streams before it commits (larger than its
//! `logical_decoding_work_mem`) is applied the same way from its first
//! segment (`stream::StreamedEarly`), with what is not known yet standing
//! in (`TxnMeta::streaming`): no commit LSN, and a commit timestamp of
//! `-infinity`, under which the fast path's checks only pass changes whose
//! outcome cannot depend on the real timestamp (rows of this publisher or
//! without history, new keys with no tombstone and no truncate but the
//! publisher's own, which it committed before). Any other
//! change, and anything that fails, rolls the early part back; the
//! transaction is then applied whole from the spool at its STREAM COMMIT,
//! where a failure names its real commit LSN. The stream gives up early
//! apply as soon as anything else must commit first (another
//! transaction's BEGIN or segment) or a subtransaction aborts.
//!
//! Invariants, as for `Applier::apply`:
//! - Nothing commits before the COMMIT arrives: the progress record and
//!   COMMIT are only queued by `commit_early`.
//! - Exactly-once and commit order: the transactions before it are settled
//!   first (`begin_early`), so a failure while it arrives is its own. A
//!   conflict rolls the pipeline back (`recover`), which ends early apply
//!   (`Applier::early` is cleared wherever the pipeline rolls back); at its
//!   COMMIT the transaction is then applied whole from its kept changes,
//!   like any other (fast path, then careful). A crash leaves an
//!   uncommitted local transaction, which PostgreSQL rolls back.

use std::sync::Arc;

use mm_proto::Lsn;
use mm_proto::pgoutput::Message;

use super::ApplyFailure;
use super::applier::Applier;
use super::txn::{TxnBody, TxnMeta};

impl Applier {
    /// Opens the local transaction of `meta` (end LSN unknown: its commit
    /// LSN stands in) before its COMMIT arrived. False: not now (right
    /// after conflicts, when each transaction is settled alone; or an
    /// operator asked to skip it); it is applied at its COMMIT instead.
    pub async fn begin_early(&mut self, meta: &TxnMeta) -> Result<bool, ApplyFailure> {
        if self.early.is_some() || self.streak > 0 || self.skips.contains(&meta.commit_lsn) {
            return Ok(false);
        }
        self.settle_all().await?;
        let guard = self.enter_gate().await.map_err(|f| with_txn(f, meta))?;
        let mut pipe = self.take_pipe()?;
        // Held through the commits before it; `commit_early` sets its end.
        pipe.hold(Lsn(u64::MAX), guard);
        let r = self.queue_begin(&mut pipe, meta).await;
        self.pipe = Some(pipe);
        self.early = Some(*meta);
        self.early_result(r, meta).await?;
        Ok(self.early.is_some())
    }

    /// Queues the next changes of the transaction begun early; nothing
    /// when it no longer is (rolled back: it waits for its COMMIT).
    pub async fn queue_early(&mut self, msgs: Vec<Message>) -> Result<(), ApplyFailure> {
        let Some(meta) = self.early else {
            return Ok(());
        };
        let mut pipe = self.take_pipe()?;
        let r = self
            .queue_changes(&mut pipe, &meta, &mut msgs.into_iter())
            .await;
        self.pipe = Some(pipe);
        self.early_result(r, &meta).await
    }

    /// A transaction's COMMIT arrived: queues the changes not queued yet
    /// (`rest`), its progress record and COMMIT when it was begun early
    /// (true); otherwise applies it whole (`apply`, false).
    pub async fn commit_early(
        &mut self,
        meta: &TxnMeta,
        body: TxnBody,
        rest: Vec<Message>,
    ) -> Result<bool, ApplyFailure> {
        let mine = self.early.is_some_and(|e| {
            e.xid == meta.xid && (!e.commit_known() || e.commit_lsn == meta.commit_lsn)
        });
        if mine && self.skips.contains(&meta.commit_lsn) {
            // Known to be skipped only now (a streamed one): not applied.
            self.abandon_early().await?;
        }
        if !mine || self.early.is_none() {
            return self.apply(meta, body).await.map(|()| false);
        }
        self.early = None;
        self.queued
            .push_back((*meta, Arc::clone(&body), Arc::clone(&self.wm)));
        let mut pipe = self.take_pipe()?;
        pipe.rekey_last(meta.end_lsn);
        let mut r = self
            .queue_changes(&mut pipe, meta, &mut rest.into_iter())
            .await;
        if r.is_ok() {
            r = self.finish_queue(&mut pipe, meta).await;
        }
        self.pipe = Some(pipe);
        match r {
            Ok(()) => {
                self.next_expected = meta.end_lsn;
                Ok(true)
            }
            Err(f) if f.conflict => self.recover(with_txn(f, meta)).await.map(|()| true),
            Err(f) => Err(with_txn(f, meta)),
        }
    }

    /// Gives up applying the transaction while it arrives: rolls its part
    /// back, which lets go of the gate and its row locks; it is applied
    /// whole at its COMMIT. For a publisher that stops sending in the
    /// middle (a partition, a stalled walsender): the gate is shared by
    /// every stream into this node, and their careful transactions must not
    /// wait on a network they do not use.
    pub async fn abandon_early(&mut self) -> Result<(), ApplyFailure> {
        if self.early.is_none() {
            return Ok(());
        }
        let latest = Arc::clone(&self.wm);
        // Empty: everything before it was settled when it began
        // (`begin_early`); queued again all the same if not.
        let pending = self.roll_back_pipeline().await?;
        for (m, b, w) in pending {
            self.wm = Arc::clone(&w);
            self.queued.push_back((m, Arc::clone(&b), w));
            self.queue_fast(&m, &b).await?;
        }
        self.wm = latest;
        Ok(())
    }

    /// Whether a transaction is being applied while it arrives: false once
    /// a conflict or failure rolled it back.
    pub fn is_early(&self) -> bool {
        self.early.is_some()
    }

    /// A conflict while the transaction arrives: everything before it is
    /// committed, so rolling back loses only its own part, applied whole
    /// at its COMMIT. So does any failure of a streamed one, whose commit
    /// LSN (what an error names, what `mmctl skip` takes) is not known yet:
    /// applied whole, it fails again with it.
    async fn early_result(
        &mut self,
        r: Result<(), ApplyFailure>,
        meta: &TxnMeta,
    ) -> Result<(), ApplyFailure> {
        match r {
            Ok(()) => Ok(()),
            Err(f) => {
                tracing::debug!(xid = meta.xid, error = %f, "met while the transaction arrives");
                self.resolve_failure(with_txn(f, meta)).await
            }
        }
    }

    /// A failure met in the pipeline: a conflict is resolved (`recover`);
    /// any other failure of a streamed transaction applied before its
    /// commit rolls that part back (applied whole at the commit, it fails
    /// again naming its commit LSN); the rest is the stream's error.
    pub async fn resolve_failure(&mut self, f: ApplyFailure) -> Result<(), ApplyFailure> {
        if self.lanes.is_some() {
            return self.lanes_failure(f).await;
        }
        self.resolve_failure_alone(f).await
    }

    /// `resolve_failure` once nothing is in flight on any other lane.
    pub(super) async fn resolve_failure_alone(
        &mut self,
        mut f: ApplyFailure,
    ) -> Result<(), ApplyFailure> {
        if f.conflict {
            return self.recover(f).await;
        }
        if let Some(t) = f.txn.filter(|t| !t.commit_known()) {
            if self.early.is_some() {
                return self.abandon_early().await;
            }
            // Its COMMIT arrived and the rest of it was queued behind the
            // failed statement (`commit_early`), so nothing is left to roll
            // back and apply whole: the failure is the transaction's own,
            // named by its commit LSN. Taken for an early part's, it was
            // dropped, and the statement behind it was reported instead
            // ("current transaction is aborted").
            if let Some((m, _, _)) = self.queued.iter().find(|(m, _, _)| m.xid == t.xid) {
                f.txn = Some(*m);
            }
        }
        Err(f)
    }
}

/// The transaction a failure belongs to, when the statement did not say:
/// `meta`; also in place of the stand-in of a streamed transaction
/// (`TxnMeta::streaming`) whose commit `meta` now knows.
fn with_txn(mut f: ApplyFailure, meta: &TxnMeta) -> ApplyFailure {
    match f.txn {
        Some(t) if t.commit_known() || t.xid != meta.xid => {}
        _ => f.txn = Some(*meta),
    }
    f
}
