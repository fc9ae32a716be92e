//! Pipelined execution of one transaction's statements on one session.
//!
//! Every statement is sent as soon as it is queued (without waiting for the
//! previous reply), and replies are consumed in order. A single-row transaction
//! thus costs one network round trip; a large one streams. The in-flight window
//! bounds memory.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use futures_util::StreamExt;
use futures_util::stream::FuturesOrdered;
use tokio_postgres::{Client, Statement};

use super::{ApplyFailure, Param};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    Control,
    Insert,
    Update,
    Delete,
    Truncate,
}

#[derive(Debug, Clone)]
pub struct OpMeta {
    pub kind: OpKind,
    pub relation: Option<Arc<str>>,
}

type OpFuture = Pin<Box<dyn Future<Output = (OpMeta, Result<u64, tokio_postgres::Error>)> + Send>>;

/// Result counters of the settled statements.
#[derive(Debug, Default)]
pub struct Settled {
    pub rows: u64,
    /// (conflict type, relation) for UPDATE/DELETE that found no row.
    pub missing: Vec<(&'static str, Arc<str>)>,
}

pub struct Pipeline {
    client: Arc<Client>,
    inflight: FuturesOrdered<OpFuture>,
    window: usize,
    pub settled: Settled,
}

impl Pipeline {
    pub fn new(client: Arc<Client>, window: usize) -> Self {
        Pipeline {
            client,
            inflight: FuturesOrdered::new(),
            window,
            settled: Settled::default(),
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
    /// is returned; later statements of the (now aborted) transaction are not
    /// waited for, as the session is discarded after a failure.
    pub async fn settle(&mut self, keep: usize) -> Result<(), ApplyFailure> {
        while self.inflight.len() > keep {
            let Some((meta, res)) = self.inflight.next().await else {
                break;
            };
            match res {
                Ok(n) => {
                    self.settled.rows += match meta.kind {
                        OpKind::Insert | OpKind::Update | OpKind::Delete => n,
                        _ => 0,
                    };
                    if n == 0 {
                        let ty = match meta.kind {
                            OpKind::Update => Some("update_missing"),
                            OpKind::Delete => Some("delete_missing"),
                            _ => None,
                        };
                        if let (Some(ty), Some(rel)) = (ty, meta.relation.clone()) {
                            self.settled.missing.push((ty, rel));
                        }
                    }
                }
                Err(e) => return Err(ApplyFailure::from_pg(meta.relation.as_deref(), &e)),
            }
        }
        Ok(())
    }
}
