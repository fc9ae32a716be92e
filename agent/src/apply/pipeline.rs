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
//! progress update (`mm.advance_progress`) only succeeds when the stored
//! progress is exactly the previous transaction's end, so a transaction whose
//! predecessor rolled back fails too, and the first failure is reported.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use futures_util::StreamExt;
use futures_util::stream::FuturesOrdered;
use tokio_postgres::{Client, Statement};

use super::{ApplyFailure, Param, TxnMeta};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    Control,
    Insert,
    Update,
    Delete,
    Truncate,
    /// The transaction's COMMIT: when it succeeds, the transaction is done.
    Commit,
}

#[derive(Debug, Clone)]
pub struct OpMeta {
    pub kind: OpKind,
    pub relation: Option<Arc<str>>,
    pub txn: TxnMeta,
}

type OpFuture = Pin<Box<dyn Future<Output = (OpMeta, Result<u64, tokio_postgres::Error>)> + Send>>;

/// A remote transaction whose local commit succeeded.
#[derive(Debug)]
pub struct Done {
    pub meta: TxnMeta,
    pub rows: u64,
    /// (conflict type, relation) for UPDATE/DELETE that found no row.
    pub missing: Vec<(&'static str, Arc<str>)>,
}

pub struct Pipeline {
    client: Arc<Client>,
    inflight: FuturesOrdered<OpFuture>,
    window: usize,
    rows: u64,
    missing: Vec<(&'static str, Arc<str>)>,
    pub done: VecDeque<Done>,
}

impl Pipeline {
    pub fn new(client: Arc<Client>, window: usize) -> Self {
        Pipeline {
            client,
            inflight: FuturesOrdered::new(),
            window,
            rows: 0,
            missing: Vec::new(),
            done: VecDeque::new(),
        }
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
        let mut fut: OpFuture = Box::pin(async move {
            let r = client.execute_raw(&stmt, params).await;
            (meta, r)
        });
        let first = {
            let mut cx = Context::from_waker(Waker::noop());
            fut.as_mut().poll(&mut cx)
        };
        match first {
            Poll::Ready(out) => self
                .inflight
                .push_back(Box::pin(std::future::ready(out)) as OpFuture),
            Poll::Pending => self.inflight.push_back(fut),
        }
        if self.inflight.len() > self.window {
            self.settle(self.window / 2).await?;
        }
        Ok(())
    }

    /// Waits until at most `keep` statements are in flight. The first failure
    /// is returned with the transaction it belongs to; the session is
    /// discarded after a failure, so later replies are not waited for.
    pub async fn settle(&mut self, keep: usize) -> Result<(), ApplyFailure> {
        while self.inflight.len() > keep {
            let Some((meta, res)) = self.inflight.next().await else {
                break;
            };
            match res {
                Ok(n) => match meta.kind {
                    OpKind::Insert | OpKind::Update | OpKind::Delete => {
                        self.rows += n;
                        if n == 0 && meta.kind != OpKind::Insert {
                            let ty = if meta.kind == OpKind::Update {
                                "update_missing"
                            } else {
                                "delete_missing"
                            };
                            if let Some(rel) = meta.relation.clone() {
                                self.missing.push((ty, rel));
                            }
                        }
                    }
                    OpKind::Commit => self.done.push_back(Done {
                        meta: meta.txn,
                        rows: std::mem::take(&mut self.rows),
                        missing: std::mem::take(&mut self.missing),
                    }),
                    OpKind::Control | OpKind::Truncate => {}
                },
                Err(e) => {
                    let mut f = ApplyFailure::from_pg(meta.relation.as_deref(), &e);
                    f.txn = Some(meta.txn);
                    return Err(f);
                }
            }
        }
        Ok(())
    }

    pub fn in_flight(&self) -> usize {
        self.inflight.len()
    }
}
