//! Pipelined execution of statements on the apply session, across
//! transactions.
//!
//! Every statement is sent as soon as it is queued (without waiting for the
//! previous reply) and replies are consumed in order, so neither a round trip
//! per statement nor one per transaction limits throughput. The in-flight
//! window bounds memory.
//!
//! Invariant (commit order, nothing skipped): transactions are still applied
//! one after another on one session, in the publisher's commit order. If one
//! fails, the ones queued behind it must not commit: each transaction's
//! progress guard (`sql::advance_progress`) only succeeds when the stored
//! progress is exactly the previous transaction's end, so a transaction whose
//! predecessor rolled back fails too, and the first failure is reported.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use futures_util::StreamExt;
use futures_util::stream::FuturesOrdered;
use sync_wrapper::SyncWrapper;
use tokio_postgres::{Client, Statement};

use super::{ApplyFailure, Param, TxnMeta};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    Control,
    Insert,
    Update,
    /// An UPDATE that settles its own conflict (`sql::fast_update_in_place`):
    /// its first column is the conflicts it logged.
    UpdateInPlace,
    Delete,
    Truncate,
    /// An orphan check (`fk.rs`): its row count is the orphans it logged.
    OrphanCheck,
    /// The transaction's COMMIT: when it succeeds, the transaction is done.
    Commit,
}

#[derive(Debug, Clone)]
pub struct OpMeta {
    pub kind: OpKind,
    pub relation: Option<Arc<str>>,
    pub txn: TxnMeta,
    /// Rows a row statement changes when it succeeds (fast-path statements
    /// fail unless they change exactly these).
    pub rows: u64,
    /// Its success commits the transaction: COMMIT, or a row statement that
    /// is a whole transaction by itself (`sql::Commit::Fused`).
    pub commits: bool,
}

/// Rows in flight before `push` waits for replies: enough 1000-row INSERTs
/// to keep the apply backend busy, few enough that memory stays flat in
/// transaction size.
const ROW_WINDOW: u64 = 20_000;

type OpFuture = Pin<Box<dyn Future<Output = (OpMeta, Result<u64, tokio_postgres::Error>)> + Send>>;

/// A remote transaction whose local commit succeeded.
#[derive(Debug)]
pub struct Done {
    pub meta: TxnMeta,
    pub rows: u64,
    /// (conflict type, relation) of every true conflict it resolved; all of
    /// them are also rows of `mm.conflict_log` committed with it.
    pub conflicts: Vec<(&'static str, Arc<str>)>,
    /// Changes to rows last written by another origin that were routine
    /// (the publisher had seen that version), resolved without a resolver.
    pub routine: u64,
    /// Applied on the careful path after its fast-path attempt met a
    /// conflict and was rolled back.
    pub rolled_back: bool,
    /// Conflicts settled inside a fast-path statement (also in `conflicts`).
    pub in_place: u64,
}

pub struct Pipeline {
    client: Arc<Client>,
    /// Only ever touched through `&mut self`; the wrapper makes the applier
    /// `Sync` so the careful path can borrow it across awaits.
    inflight: SyncWrapper<FuturesOrdered<OpFuture>>,
    /// `inflight`'s length, readable through `&self`.
    count: usize,
    window: usize,
    /// Rows of the row statements in flight: their parameters are held
    /// until answered. The statement window alone let a 1M-row transaction
    /// in 1000-row INSERTs be in flight whole (agent RSS 58 -> 212 MB).
    rows_in_flight: u64,
    rows: u64,
    /// Conflicts logged by fast-path statements of the transaction being
    /// settled (orphans, conflicts settled in place), by relation.
    logged: Vec<(&'static str, Arc<str>)>,
    in_place: u64,
    pub done: VecDeque<Done>,
    /// The gate (`gate.rs`), held shared by every queued transaction (by
    /// end LSN) until its commit's reply is read or the pipeline drained.
    guards: VecDeque<(mm_proto::Lsn, super::gate::Shared)>,
    /// Statements pushed and replies read, ever: an apply lane waits for
    /// another lane's statement by its number (`lanes.rs`).
    pushed: u64,
    answered: u64,
    /// `settle` returned a failure and the pipeline was not drained since:
    /// the replies after it must not be read as successes (a COMMIT of an
    /// aborted transaction answers like one).
    failed: bool,
}

impl Pipeline {
    pub fn new(client: Arc<Client>, window: usize) -> Self {
        Pipeline {
            client,
            inflight: SyncWrapper::new(FuturesOrdered::new()),
            count: 0,
            window,
            rows_in_flight: 0,
            rows: 0,
            logged: Vec::new(),
            in_place: 0,
            done: VecDeque::new(),
            guards: VecDeque::new(),
            pushed: 0,
            answered: 0,
            failed: false,
        }
    }

    /// The number the next pushed statement gets.
    pub fn pushed(&self) -> u64 {
        self.pushed
    }

    /// Whether the reply to statement number `op` has been read.
    pub fn answered(&self, op: u64) -> bool {
        self.answered > op
    }

    pub fn failed(&self) -> bool {
        self.failed
    }

    /// Holds `guard` until the transaction ending at `end` has committed
    /// (or the pipeline is drained).
    pub fn hold(&mut self, end: mm_proto::Lsn, guard: super::gate::Shared) {
        self.guards.push_back((end, guard));
    }

    /// The last transaction held for learned its end LSN (it was held
    /// while it still arrived, `early.rs`, under `Lsn::MAX`, which keeps it
    /// held through the commits of those before it).
    pub fn rekey_last(&mut self, end: mm_proto::Lsn) {
        if let Some((l, _)) = self.guards.back_mut() {
            *l = end;
        }
    }

    /// Lets go of the gate for every transaction up to `end`.
    fn release(&mut self, end: mm_proto::Lsn) {
        while self.guards.front().is_some_and(|(l, _)| *l <= end) {
            self.guards.pop_front();
        }
    }

    /// Lets go of the gate entirely: nothing queued is uncommitted.
    pub fn release_all(&mut self) {
        self.guards.clear();
    }

    /// Queues and SENDS a statement. The first poll of a tokio-postgres query
    /// future enqueues its protocol messages on the connection; polling it here,
    /// once, fixes the send order to the queue order regardless of when the
    /// ordered set is polled next.
    pub async fn push(
        &mut self,
        stmt: &Statement,
        params: Vec<Param>,
        meta: OpMeta,
    ) -> Result<(), ApplyFailure> {
        let client = Arc::clone(&self.client);
        let stmt = stmt.clone();
        self.rows_in_flight += meta.rows;
        self.pushed += 1;
        let mut fut: OpFuture = if meta.kind == OpKind::UpdateInPlace {
            Box::pin(async move {
                let r = logged_count(&client, &stmt, params).await;
                (meta, r)
            })
        } else {
            Box::pin(async move {
                let r = client.execute_raw(&stmt, params).await;
                (meta, r)
            })
        };
        let first = {
            let mut cx = Context::from_waker(Waker::noop());
            fut.as_mut().poll(&mut cx)
        };
        match first {
            Poll::Ready(out) => self
                .inflight
                .get_mut()
                .push_back(Box::pin(std::future::ready(out)) as OpFuture),
            Poll::Pending => self.inflight.get_mut().push_back(fut),
        }
        self.count = self.inflight.get_mut().len();
        if self.count > self.window {
            self.settle(self.window / 2).await?;
        }
        if self.rows_in_flight > ROW_WINDOW {
            while self.rows_in_flight > ROW_WINDOW / 2 && self.count > 0 {
                self.settle(self.count - 1).await?;
            }
        }
        Ok(())
    }

    /// Waits until at most `keep` statements are in flight. The first failure
    /// is returned with the transaction it belongs to; the session is
    /// discarded after a failure, so later replies are not waited for.
    pub async fn settle(&mut self, keep: usize) -> Result<(), ApplyFailure> {
        while self.inflight.get_mut().len() > keep {
            let next = self.inflight.get_mut().next().await;
            self.count = self.inflight.get_mut().len();
            let Some((meta, res)) = next else {
                break;
            };
            self.answered += 1;
            self.rows_in_flight = self.rows_in_flight.saturating_sub(meta.rows);
            match res {
                Ok(n) if meta.kind == OpKind::OrphanCheck => {
                    if n > 0
                        && let Some(rel) = &meta.relation
                    {
                        super::fk::warn_orphans(rel, n, meta.txn.commit_lsn);
                        for _ in 0..n {
                            self.logged.push((super::fk::ORPHAN, Arc::clone(rel)));
                        }
                    }
                }
                Ok(n) if meta.kind == OpKind::UpdateInPlace => {
                    self.rows += meta.rows;
                    if let Some(rel) = &meta.relation {
                        for _ in 0..n {
                            self.logged.push((
                                crate::conflict::ConflictType::UpdateOriginDiffers.as_str(),
                                Arc::clone(rel),
                            ));
                        }
                    }
                    self.in_place += n;
                    if meta.commits {
                        self.finish(meta.txn);
                    }
                }
                Ok(_) => {
                    // Fast-path row statements fail unless they change every
                    // row; success means they changed exactly `meta.rows`.
                    if matches!(meta.kind, OpKind::Insert | OpKind::Update | OpKind::Delete) {
                        self.rows += meta.rows;
                    }
                    if meta.commits {
                        self.finish(meta.txn);
                    }
                }
                Err(e) => {
                    let mut f = ApplyFailure::from_pg(meta.relation.as_deref(), &e);
                    f.txn = Some(meta.txn);
                    // A fast-path row statement refused (MM001) or hit a
                    // unique key: the transaction needs the resolver.
                    f.conflict = matches!(
                        meta.kind,
                        OpKind::Insert | OpKind::Update | OpKind::UpdateInPlace | OpKind::Delete
                    ) && f.signal.is_some();
                    self.rows = 0;
                    self.logged.clear();
                    self.in_place = 0;
                    self.failed = true;
                    return Err(f);
                }
            }
        }
        Ok(())
    }

    /// The transaction whose commit just succeeded is done.
    fn finish(&mut self, txn: TxnMeta) {
        self.release(txn.end_lsn);
        self.done.push_back(Done {
            meta: txn,
            rows: std::mem::take(&mut self.rows),
            conflicts: std::mem::take(&mut self.logged),
            routine: 0,
            rolled_back: false,
            in_place: std::mem::take(&mut self.in_place),
        });
    }

    pub fn in_flight(&self) -> usize {
        self.count
    }

    /// Whether the stream should read more now: the apply backend has less
    /// than a quarter of either window left to work on. Reading while it
    /// still has plenty only moves the backlog from the socket into memory,
    /// and a reader that drains the socket as fast as the walsender fills
    /// it is woken per message, and makes the walsender send per message:
    /// on 2 cores that cost the agent and the walsender twice their CPU
    /// in some backlog runs, and the catch-up 40% of its speed.
    pub fn wants_more(&self) -> bool {
        self.count < self.window / 4 && self.rows_in_flight < ROW_WINDOW / 4
    }

    /// After a failure: waits out every statement still in flight, ignoring
    /// their results (they all belong to transactions that roll back: the
    /// failed one, and those queued behind it, whose progress guard fails).
    pub async fn drain(&mut self) {
        while self.inflight.get_mut().next().await.is_some() {}
        self.answered = self.pushed;
        self.failed = false;
        self.guards.clear();
        self.count = 0;
        self.rows_in_flight = 0;
        self.rows = 0;
        self.logged.clear();
        self.in_place = 0;
    }
}

/// Runs a resolving UPDATE: its first column is the conflicts it logged.
async fn logged_count(
    client: &Client,
    stmt: &Statement,
    params: Vec<Param>,
) -> Result<u64, tokio_postgres::Error> {
    let rows = client.query_raw(stmt, params).await?;
    futures_util::pin_mut!(rows);
    let mut n = 0u64;
    while let Some(row) = futures_util::TryStreamExt::try_next(&mut rows).await? {
        let logged: i32 = row.try_get(0)?;
        n += u64::try_from(logged).unwrap_or(0);
    }
    Ok(n)
}
