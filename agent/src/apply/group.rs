//! Grouped apply: consecutive small transactions of one publisher, received
//! while the apply session is behind, applied as one local transaction.
//!
//! A single-row transaction costs the apply backend a statement, a progress
//! record and a commit: ~60-75 us of backend CPU, 4-5x what PostgreSQL's
//! own apply worker spends on it, and the backend is the bottleneck of a
//! catch-up. A group spends one BEGIN, one progress record and one COMMIT
//! on up to `replication.group_transactions` transactions (default 1: off),
//! and their inserts into one table go out as multi-row INSERTs.
//!
//! Invariants:
//! - Exactly-once and commit order: the group's progress record expects
//!   the progress before its first transaction and stores its last one's
//!   end, in the same local transaction as every change: all of the group
//!   commits, or none, and the stream resumes after the last transaction
//!   committed. A failure rolls the whole group back; `recover` applies
//!   its transactions again, one local transaction each.
//! - Readers see the publisher's states only: the group's commit shows
//!   the state after its last transaction, which the publisher had.
//! - Conflict checks are per transaction: every row carries its own
//!   transaction's commit timestamp and the publisher's watermark into its
//!   statement (`merge.rs` merges a group's changes per table and kind;
//!   inserts merged across transactions carry the earliest, which only
//!   makes the truncate check stricter). A row the group wrote before has no commit
//!   yet, which `mm.routine` takes as routine: only the same publisher's
//!   earlier transactions write inside the group.
//! - Versions: the commit stamps every row the group wrote with its last
//!   transaction's timestamp and the publisher's origin. Later changes
//!   compare against that stamp instead of each row's own, slightly older
//!   one; `Watermarks::may_group` admits a transaction only when no change
//!   that reaches this node later can be judged differently by it.
//! - Durability-gated feedback: one local commit, one WAL position; the
//!   gate (`durable.rs`) is unchanged.
//!
//! A group is held in memory and sent when it is full, when a transaction
//! that cannot join it arrives, and before the stream would wait for the
//! publisher (`stream::run`, `close_group`), so it adds no latency to a
//! stream that keeps up; only in a backlog, after a full group, it waits a
//! moment for more (`group_may_wait`).

use std::sync::Arc;

use mm_proto::pgoutput::Message;

use super::ApplyFailure;
use super::Param;
use super::applier::{Applier, Watermark};
use super::fast::control_op;
use super::pipeline::{OpKind, Pipeline};
use super::txn::{TxnBody, TxnMeta};

/// A transaction with more row changes than this is applied alone: it
/// already amortises its own commit.
const MAX_TXN_ROWS: usize = 10;

/// Transactions held to be applied together, in commit order.
#[derive(Default)]
pub(crate) struct Group {
    txns: Vec<(TxnMeta, TxnBody, Arc<Vec<Message>>)>,
    /// The publisher's watermark they were all received under (`recover`
    /// holds transactions queued under different ones).
    wm: Option<Arc<Watermark>>,
    /// The last group sent was full: the stream is working off a backlog.
    last_full: bool,
    /// Held as a batch (`batch.rs`: groups are off, or would not take
    /// these): transactions of this shape, each to commit on its own.
    batch: Option<super::batch::Shape>,
}

impl Applier {
    /// Whether a group is held, not yet sent.
    pub fn group_open(&self) -> bool {
        !self.group.txns.is_empty()
    }

    /// Whether a group held while nothing is ready to read should wait a
    /// moment for more (`stream::run`): only while working off a backlog,
    /// where the last group filled up. The walsender is then the slower
    /// side, and a group sent at once is small: its commit and progress
    /// record cost the apply backend CPU the walsender needs. A stream
    /// that keeps up sends groups of one, never full: it never waits.
    pub fn group_may_wait(&self) -> bool {
        self.group.last_full && self.group_full() == Some(false)
    }

    /// Holds `meta` in the group when it can join one (`may_hold`) and the
    /// stream is not in a streak of conflicts (`recover.rs`).
    pub(super) fn hold_in_group(&mut self, meta: &TxnMeta, body: &TxnBody) -> bool {
        self.streak == 0 && self.group_full().is_some() && self.may_hold(meta, body)
    }

    /// Holds `meta` in the group when it can join one: a transaction of
    /// row changes only, into tables without foreign keys (their orphan
    /// checks run before each transaction's commit), none of them large,
    /// not to be skipped, received under the same watermark as the rest,
    /// and every third node allows it (`Watermarks::may_group`).
    pub(super) fn may_hold(&mut self, meta: &TxnMeta, body: &TxnBody) -> bool {
        if self.group_limit().is_none()
            || self.lanes.is_some()
            || self.early.is_some()
            || !meta.commit_known()
            || self.skips.contains(&meta.commit_lsn)
            || self
                .group
                .wm
                .as_ref()
                .is_some_and(|w| !Arc::ptr_eq(w, &self.wm))
        {
            return false;
        }
        let Some(msgs) = body.messages() else {
            return false;
        };
        if self.ctx.group_transactions <= 1 || self.group.batch.is_some() {
            return self.may_batch(meta, body, msgs);
        }
        let grouped = self.groupable(&msgs)
            && meta
                .commit_ts
                .to_datetime()
                .is_some_and(|ts| self.ctx.applied.may_group(&self.ctx.peer, ts));
        if !grouped {
            // What a group refuses (a third node not heard from lately)
            // may still go in a batch, each
            // transaction committed on its own: a batch needs no third
            // node's announcements.
            return !self.group_open() && self.may_batch(meta, body, msgs);
        }
        self.group.txns.push((*meta, Arc::clone(body), msgs));
        self.group.wm = Some(Arc::clone(&self.wm));
        true
    }

    /// Holds `meta` in the batch (`batch.rs`) when its row changes have
    /// the batch's shape. Every transaction keeps its own commit, so no
    /// third node's announcements are needed, unlike a group's.
    fn may_batch(&mut self, meta: &TxnMeta, body: &TxnBody, msgs: Arc<Vec<Message>>) -> bool {
        if self.batch_limit().is_none() {
            return false;
        }
        let Some(shape) = self.batch_shape(&msgs) else {
            return false;
        };
        if self.group_open() && self.group.batch.as_ref().is_some_and(|s| *s != shape) {
            return false;
        }
        self.group.batch = Some(shape);
        self.group.txns.push((*meta, Arc::clone(body), msgs));
        self.group.wm = Some(Arc::clone(&self.wm));
        true
    }

    /// Transactions a group holds at most: a batch's when it holds one
    /// (or groups are off and batches can be run), `group_transactions`
    /// otherwise; None when neither is used.
    fn group_limit(&self) -> Option<usize> {
        if self.ctx.group_transactions > 1 && self.group.batch.is_none() {
            return Some(self.ctx.group_transactions);
        }
        self.batch_limit()
    }

    /// Transactions a batch holds at most, when the session can run
    /// batches (one lane, the procedure could be created).
    fn batch_limit(&self) -> Option<usize> {
        (self.lanes.is_none() && self.pipe.as_ref().is_some_and(|p| p.batches()))
            .then_some(super::batch::BATCH_TXNS)
    }

    fn groupable(&self, msgs: &[Message]) -> bool {
        let mut rows = 0;
        for m in msgs {
            match m {
                Message::Insert(_) | Message::Update(_) | Message::Delete(_) => {
                    let known = super::hot::relation_of(m)
                        .and_then(|oid| self.relations.get(&oid))
                        .is_some_and(|r| r.fks.is_none());
                    if !known {
                        return false;
                    }
                    rows += 1;
                }
                // Nothing to apply (see `queue_changes`).
                Message::Type(_) | Message::Origin(_) => {}
                // Relations, truncates, logical messages: on their own.
                _ => return false,
            }
        }
        (1..=MAX_TXN_ROWS).contains(&rows)
    }

    /// Whether the group has room: Some(false) when it has, Some(true)
    /// when it is full, None when groups are off.
    fn group_full(&self) -> Option<bool> {
        let held = self.group.txns.len();
        self.group_limit().map(|limit| held >= limit)
    }

    /// Sends the group when it is full.
    pub(super) async fn close_full_group(&mut self) -> Result<(), ApplyFailure> {
        if self.group_full() == Some(true) {
            self.close_group().await
        } else {
            Ok(())
        }
    }

    /// Sends the transactions held: a lone one as it would have gone
    /// without a group (one statement when it is one change), more as
    /// one local transaction. A conflict is recovered here, as in `apply`.
    pub async fn close_group(&mut self) -> Result<(), ApplyFailure> {
        let Some(wm) = self.group.wm.take() else {
            return Ok(());
        };
        let limit = self.group_limit();
        let txns = std::mem::take(&mut self.group.txns);
        let batch = self.group.batch.take();
        tracing::debug!(
            txns = txns.len(),
            batch = batch.is_some(),
            "sending a group"
        );
        self.group.last_full = limit.is_some_and(|l| txns.len() >= l);
        // Their checks use the watermark they came under.
        let now = std::mem::replace(&mut self.wm, wm);
        let r = match batch {
            Some(shape) if txns.len() > 1 => self.send_batch(shape, txns).await,
            _ => self.send_group(txns).await,
        };
        self.wm = now;
        r
    }

    async fn send_group(
        &mut self,
        mut txns: Vec<(TxnMeta, TxnBody, Arc<Vec<Message>>)>,
    ) -> Result<(), ApplyFailure> {
        if txns.len() <= 1 {
            return match txns.pop() {
                // Boxed: applying alone may settle everything queued,
                // which closes the (now empty) group again.
                Some((meta, body, _)) => Box::pin(self.apply_alone(&meta, body)).await,
                None => Ok(()),
            };
        }
        self.send_held(txns, None).await
    }

    /// Sends held transactions as one group, or, given a batch's CALL
    /// (`batch.rs`), as that CALL. A failure is recovered here, as in
    /// `apply`.
    pub(super) async fn send_held(
        &mut self,
        txns: Vec<(TxnMeta, TxnBody, Arc<Vec<Message>>)>,
        call: Option<super::batch::Call>,
    ) -> Result<(), ApplyFailure> {
        let (first, last) = match (txns.first(), txns.last()) {
            (Some(f), Some(l)) => (f.0, l.0),
            _ => return Ok(()),
        };
        // Queued before anything can fail: `recover` applies them again.
        for (meta, body, _) in &txns {
            self.queued
                .push_back((*meta, Arc::clone(body), Arc::clone(&self.wm)));
        }
        let r = match self.enter_gate().await {
            Ok(guard) => {
                let mut pipe = self.take_pipe()?;
                pipe.hold(last.end_lsn, guard);
                let r = match call {
                    None => self.queue_group(&mut pipe, &txns).await,
                    Some(c) => {
                        let metas: Vec<TxnMeta> = txns.iter().map(|t| t.0).collect();
                        pipe.push_call(&c.stmt, &c.params, &metas, c.display, &self.origin)
                            .await
                    }
                };
                self.pipe = Some(pipe);
                // Met while queuing (a value that does not convert, a key
                // column not sent, ...): which of the group's transactions
                // it belongs to is only sure when each is applied alone
                // (`recover`), which then fails naming it.
                r.map_err(|mut f| {
                    f.txn.get_or_insert(first);
                    f.conflict = true;
                    f
                })
            }
            Err(f) => Err(f),
        };
        match r {
            Ok(()) => {
                self.next_expected = last.end_lsn;
                Ok(())
            }
            Err(f) if f.conflict => Box::pin(self.recover(f)).await,
            Err(f) => Err(f),
        }
    }

    /// BEGIN, every transaction's changes, one progress record over all of
    /// them, COMMIT.
    async fn queue_group(
        &mut self,
        pipe: &mut Pipeline,
        txns: &[(TxnMeta, TxnBody, Arc<Vec<Message>>)],
    ) -> Result<(), ApplyFailure> {
        let (Some((first, _, _)), Some((last, _, _))) = (txns.first(), txns.last()) else {
            return Ok(());
        };
        let (first, last) = (*first, *last);
        let prev = self.next_expected;
        self.queue_begin(pipe, &first).await?;
        // Every row change, in commit order, merged into one statement per
        // table and kind where they commute (`merge.rs`).
        let changes: Vec<(TxnMeta, &Message)> = txns
            .iter()
            .flat_map(|(meta, _, msgs)| msgs.iter().map(move |m| (*meta, m)))
            .filter(|(_, m)| super::hot::relation_of(m).is_some())
            .collect();
        let plan = changes
            .iter()
            .map(|(_, m)| self.change_of(m))
            .collect::<Result<Vec<_>, _>>()?;
        for batch in super::merge::plan(&plan) {
            let batch = batch.into_iter().map(|i| changes[i]).collect();
            self.queue_batch(pipe, batch).await?;
        }
        for (meta, _, _) in txns {
            if meta.end_lsn != last.end_lsn {
                pipe.grouped(*meta);
            }
        }
        // `progress_params` expects the progress before the first: it is.
        debug_assert_eq!(self.next_expected, prev);
        let mut params = self.progress_params(&last).to_vec();
        params.push(Param::int4(i32::try_from(txns.len()).unwrap_or(i32::MAX)));
        pipe.push(
            &self.advance_group.clone(),
            params,
            control_op(OpKind::Control, last),
        )
        .await?;
        self.txn_open = false;
        pipe.push(
            &self.commit.clone(),
            Vec::new(),
            control_op(OpKind::Commit, last),
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_group_of_a_hundred_is_one_multi_row_insert() {
        // The size the docs suggest for `replication.group_transactions`.
        assert!(super::super::fast::INSERT_BATCHES.contains(&100));
    }
}
