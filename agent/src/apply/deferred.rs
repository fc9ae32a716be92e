//! The careful path's writes, sent without waiting for their replies.
//!
//! A careful transaction applies one change at a time and decides each from
//! what it reads, so its reads are round trips it cannot avoid. Its writes
//! are not: nothing it decides depends on their replies (a target row is
//! locked when read, so its write changes it; the row count is only
//! counted). Under hot keys nearly every transaction is careful and one
//! round trip per write was a third of its time.
//!
//! Invariants, relied on by the careful path (`careful/`):
//! - Order: statements on one session execute in the order sent, and a
//!   write is sent here at once (its future is polled once, as in
//!   `pipeline.rs`). A later read or write of the same transaction sees it.
//! - The first failure is the one reported: a failed write aborts the
//!   transaction and every later statement fails with 25P02; `settle`
//!   returns the write's own error, and the careful path settles before it
//!   reports any other.
//! - Nothing is written outside the transaction: BEGIN goes out deferred
//!   too, and `begun` confirms it before the first write is sent (its reply
//!   came ahead of the first read's, so that costs no round trip).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use tokio_postgres::{Client, Statement};

use super::{ApplyFailure, Param};

/// A reply to read, and whether its row count counts as rows applied.
type Reply = (
    Pin<Box<dyn Future<Output = Result<u64, ApplyFailure>> + Send>>,
    bool,
);

#[derive(Default)]
pub(super) struct Deferred {
    inflight: Mutex<Vec<Reply>>,
    /// A BEGIN was sent and its reply not read yet.
    begin_unconfirmed: AtomicBool,
    /// Rows the counted writes changed, of the replies read so far.
    rows: AtomicU64,
}

impl Deferred {
    /// Sends `stmt` now; its reply is read by `settle`. `counted`: its row
    /// count is rows applied (`take_rows`).
    pub fn send(
        &self,
        client: &Arc<Client>,
        stmt: &Statement,
        params: Vec<Param>,
        relation: Option<Arc<str>>,
        counted: bool,
    ) {
        let (client, stmt) = (Arc::clone(client), stmt.clone());
        let mut fut: Pin<Box<dyn Future<Output = Result<u64, ApplyFailure>> + Send>> =
            Box::pin(async move {
                client
                    .execute_raw(&stmt, params)
                    .await
                    .map_err(|e| ApplyFailure::from_pg(relation.as_deref(), &e))
            });
        // The first poll puts the messages on the connection: the send order
        // is the call order, whenever the reply is read.
        let mut cx = Context::from_waker(Waker::noop());
        if let Poll::Ready(r) = fut.as_mut().poll(&mut cx) {
            fut = Box::pin(std::future::ready(r));
        }
        if let Ok(mut v) = self.inflight.lock() {
            v.push((fut, counted));
        }
    }

    /// Replies not read yet.
    pub fn pending(&self) -> usize {
        self.inflight.lock().map(|v| v.len()).unwrap_or(0)
    }

    /// Sends the transaction's BEGIN (and what must run right after it).
    pub fn send_begin(&self, client: &Arc<Client>, stmts: &[&Statement]) {
        for s in stmts {
            self.send(client, s, Vec::new(), None, false);
        }
        self.begin_unconfirmed.store(true, Ordering::Relaxed);
    }

    /// Reads every reply not yet read, in order; the first failure.
    pub async fn settle(&self) -> Result<(), ApplyFailure> {
        let pending = self
            .inflight
            .lock()
            .map(|mut v| std::mem::take(&mut *v))
            .unwrap_or_default();
        self.begin_unconfirmed.store(false, Ordering::Relaxed);
        for (r, counted) in pending {
            let n = r.await?;
            if counted {
                self.rows.fetch_add(n, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// Before anything that writes: the BEGIN sent went through.
    pub async fn begun(&self) -> Result<(), ApplyFailure> {
        if self.begin_unconfirmed.load(Ordering::Relaxed) {
            self.settle().await
        } else {
            Ok(())
        }
    }

    /// Rows the counted writes changed since the last call (after `settle`).
    pub fn take_rows(&self) -> u64 {
        self.rows.swap(0, Ordering::Relaxed)
    }

    /// Forgets every reply (the transaction is over either way).
    pub fn clear(&self) {
        if let Ok(mut v) = self.inflight.lock() {
            v.clear();
        }
        self.begin_unconfirmed.store(false, Ordering::Relaxed);
        self.rows.store(0, Ordering::Relaxed);
    }
}
