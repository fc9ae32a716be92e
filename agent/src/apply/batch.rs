//! Batched commits: consecutive transactions of the same row changes (one
//! to `MAX_CHANGES`, the same tables and kinds in the same order),
//! received while the apply session is behind, applied by one CALL of a
//! procedure that commits each of them on its own.
//!
//! Why: with `replication.group_transactions = 1` (the default) every
//! remote transaction is its own local commit with its own commit
//! timestamp, and a single-row one cost the apply backend ~50 us as one
//! fused statement between BEGIN and COMMIT on the pipelined session: the
//! protocol's Bind/Execute, a portal and the executor set up for a plan of
//! several CTEs, per transaction. The same work as statements of a
//! PL/pgSQL loop (cached plans, the checks evaluated as simple
//! expressions, no portal, no protocol message) costs 21-27 us (scratch
//! server, 20k transactions per shape, see docs/ARCHITECTURE.md "Apply
//! throughput"). A procedure may COMMIT inside its loop (`CALL` at the top
//! of a batch, after a Sync), so nothing of the one-commit-per-transaction
//! contract changes, unlike grouping (`group.rs`), which shares one commit.
//!
//! Invariants, each as the fused statement keeps them:
//! - Exactly-once and commit order: every transaction of the batch records
//!   its progress (expecting the previous one's end) in its own local
//!   transaction, in the publisher's order; the procedure's loop is that
//!   order. A failure rolls back the transaction it met only; those before
//!   it committed, and the progress row says which (`Pipeline::drain`
//!   reads it, `recover` starts from the first that did not).
//! - Commit timestamps and origin: each transaction's commit carries its
//!   own remote commit timestamp through the bound origin
//!   (`pg_replication_origin_xact_setup` before each COMMIT).
//! - Conflict checks are the fused statement's, per transaction: the
//!   routine guard with that transaction's timestamp, the insert re-check,
//!   `mm.one_row`; a conflict raises the same errors, and `recover` takes
//!   the transaction to the resolver.
//! - Durability-gated feedback: unchanged; the last commit of the batch is
//!   the last applied commit.
//!
//! With groups on (`replication.group_transactions` > 1), transactions a
//! group refuses (a third node not heard from lately,
//! `Watermarks::may_group`) are batched the same way: each keeps its own
//! commit, so none of a group's conditions apply.
//!
//! A batch is held like a group (`group.rs`: sent when full, when a
//! transaction that cannot join arrives, before the stream would wait for
//! the publisher), so it adds no latency to a stream that keeps up.
//! Procedures are temporary (`pg_temp`), created on the apply session at
//! first use, one per shape.

use std::sync::Arc;

use bytes::Bytes;
use mm_proto::pgoutput::{ColumnValue, Message};

use super::ApplyFailure;
use super::applier::Applier;
use super::param::Param;
use super::pipeline::Stmt;
use super::relation::LocalRelation;
use super::sql::{self, BatchChange, BatchStep, TombstoneWrite};
use super::tuple::{locate, tuple_params};
use super::txn::{TxnBody, TxnMeta};

/// Transactions one CALL applies at most.
pub(super) const BATCH_TXNS: usize = 100;

/// Row changes a batched transaction may have: more already amortise
/// their own commit (as for groups).
const MAX_CHANGES: usize = 10;

/// What makes transactions one batch: the same row changes, in the same
/// order, of the same relations and kinds (and, for deletes, one way of
/// writing tombstones).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Shape(Arc<[(u32, Kind)]>);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Insert,
    Update,
    Delete(TombstoneWrite),
}

type Held = (TxnMeta, TxnBody, Arc<Vec<Message>>);

/// A batch's CALL, ready to go (`Applier::send_held`).
pub(super) struct Call {
    pub stmt: Stmt,
    pub params: Vec<Param>,
    pub display: Arc<str>,
}

/// A table the batch procedure applies to exactly as the fused statement
/// would: keyed, outside foreign keys (their orphan checks run before each
/// commit), the tuple as wide as the relation described.
fn batchable(rel: &LocalRelation, width: usize) -> bool {
    rel.key_names().is_some() && rel.fks.is_none() && width == rel.local_names.len()
}

/// The columns a batched UPDATE sets: all but GENERATED ALWAYS identity
/// ones (the fast path's SET leaves them too).
fn settable(rel: &LocalRelation) -> impl Iterator<Item = usize> + '_ {
    (0..rel.local_names.len()).filter(|&i| !rel.always_identity.get(i).copied().unwrap_or(false))
}

impl Kind {
    /// The value arrays the procedure takes for this change of `rel`
    /// (`sql::BatchChange::arrays` of the step `batch_definition` builds).
    fn arrays(self, rel: &LocalRelation) -> usize {
        let key = rel.key_names().map_or(0, |k| k.len());
        match self {
            Kind::Insert => rel.local_names.len(),
            Kind::Update => settable(rel).count() + key,
            Kind::Delete(_) => key,
        }
    }
}

fn sent_whole(columns: &[ColumnValue]) -> bool {
    !columns
        .iter()
        .any(|c| matches!(c, ColumnValue::UnchangedToast))
}

impl Applier {
    /// The batch a transaction of `msgs` can join, if any: 1 to
    /// `MAX_CHANGES` row changes, each an INSERT, an UPDATE that keeps its
    /// key (no old tuple) and sent every column, or a DELETE, of batchable
    /// tables; nothing else but type and origin messages; and values that
    /// fit a procedure's arguments (`sql::BATCH_MAX_ARRAYS`: a wider
    /// shape's procedure could not be created).
    pub(super) fn batch_shape(&self, msgs: &[Message]) -> Option<Shape> {
        let mut steps = Vec::new();
        let mut arrays = 0;
        for m in msgs {
            let step = match m {
                Message::Insert(i) => {
                    let rel = self.relations.get(&i.relation_oid)?;
                    (batchable(rel, i.new.columns.len()) && sent_whole(&i.new.columns))
                        .then_some((i.relation_oid, Kind::Insert))?
                }
                Message::Update(u) => {
                    let rel = self.relations.get(&u.relation_oid)?;
                    (u.old.is_none()
                        && batchable(rel, u.new.columns.len())
                        && sent_whole(&u.new.columns))
                    .then_some((u.relation_oid, Kind::Update))?
                }
                Message::Delete(d) => {
                    let rel = self.relations.get(&d.relation_oid)?;
                    batchable(rel, rel.local_names.len())
                        .then_some((d.relation_oid, Kind::Delete(self.tombstone_write(rel))))?
                }
                // Nothing to apply (see `queue_changes`).
                Message::Type(_) | Message::Origin(_) => continue,
                _ => return None,
            };
            arrays += step.1.arrays(self.relations.get(&step.0)?);
            steps.push(step);
        }
        ((1..=MAX_CHANGES).contains(&steps.len()) && arrays <= sql::BATCH_MAX_ARRAYS)
            .then(|| Shape(steps.into()))
    }

    /// The procedure's signature and body for `shape`, the first table's
    /// name for errors, and the value arrays it takes.
    fn batch_definition(&self, shape: &Shape) -> Result<(String, Arc<str>, usize), ApplyFailure> {
        struct Names<'r> {
            rel: &'r LocalRelation,
            key_cols: Vec<&'r str>,
            key_types: Vec<&'r str>,
            cols: Vec<&'r str>,
            types: Vec<&'r str>,
            set_cols: Vec<&'r str>,
            set_types: Vec<&'r str>,
        }
        let mut names = Vec::with_capacity(shape.0.len());
        for (oid, _) in shape.0.iter() {
            let rel = self.rel(*oid)?;
            let Some(key_cols) = rel.key_names() else {
                return Err(ApplyFailure::new(
                    Some(&rel.display),
                    "internal: batch without a key",
                ));
            };
            let cols: Vec<&str> = rel.local_names.iter().map(String::as_str).collect();
            let types: Vec<&str> = rel.local_types.iter().map(String::as_str).collect();
            let settable: Vec<usize> = settable(rel).collect();
            names.push(Names {
                rel,
                key_cols,
                key_types: rel.key_types(),
                set_cols: settable.iter().map(|&i| cols[i]).collect(),
                set_types: settable.iter().map(|&i| types[i]).collect(),
                cols,
                types,
            });
        }
        let steps: Vec<BatchStep<'_>> = shape
            .0
            .iter()
            .zip(&names)
            .map(|((_, kind), n)| BatchStep {
                table: &n.rel.table_sql,
                relid: n.rel.relid,
                change: match *kind {
                    Kind::Insert => BatchChange::Insert {
                        cols: &n.cols,
                        types: &n.types,
                        key_cols: &n.key_cols,
                    },
                    Kind::Update => BatchChange::Update {
                        set_cols: &n.set_cols,
                        set_types: &n.set_types,
                        key_cols: &n.key_cols,
                        key_types: &n.key_types,
                    },
                    Kind::Delete(tombstones) => BatchChange::Delete {
                        key_cols: &n.key_cols,
                        key_types: &n.key_types,
                        tombstones,
                    },
                },
            })
            .collect();
        let display = names
            .first()
            .map(|n| Arc::clone(&n.rel.display))
            .unwrap_or_else(|| Arc::from(""));
        Ok((
            sql::batch_procedure(&steps),
            display,
            steps.iter().map(|s| s.change.arrays()).sum(),
        ))
    }

    /// The CALL's parameters: `sql::BATCH_FIXED_PARAMS`, then one text
    /// array per value the procedure takes, over the batch's transactions.
    fn batch_params(
        &self,
        shape: &Shape,
        txns: &[Held],
        arrays: usize,
    ) -> Result<Vec<Param>, ApplyFailure> {
        let mut columns: Vec<Vec<Option<Bytes>>> = (0..arrays)
            .map(|_| Vec::with_capacity(txns.len()))
            .collect();
        for (_, _, msgs) in txns {
            let mut col = 0;
            let changes = msgs.iter().filter(|m| super::hot::relation_of(m).is_some());
            for (change, (oid, _)) in changes.zip(shape.0.iter()) {
                let rel = self.rel(*oid)?;
                let values = match change {
                    Message::Insert(i) => tuple_params(&i.new, rel, None)?,
                    Message::Update(u) => {
                        let mut v = tuple_params(&u.new, rel, Some(&rel.set_mask(&u.new)))?;
                        v.extend(locate(rel, None, Some(&u.new))?.1);
                        v
                    }
                    Message::Delete(d) => locate(rel, Some(&d.old), None)?.1,
                    other => {
                        return Err(ApplyFailure::new(
                            Some(&rel.display),
                            format!("internal: {} in a batch", other.name()),
                        ));
                    }
                };
                for v in values {
                    let Some(column) = columns.get_mut(col) else {
                        return Err(ApplyFailure::new(
                            Some(&rel.display),
                            "internal: a batch's change does not fit its procedure",
                        ));
                    };
                    column.push(match v {
                        Param::Null => None,
                        Param::Text(b) => Some(b),
                        Param::Binary(_) => {
                            return Err(ApplyFailure::new(
                                Some(&rel.display),
                                "internal: a binary value in a batch",
                            ));
                        }
                    });
                    col += 1;
                }
            }
            if col != arrays {
                return Err(ApplyFailure::new(
                    None,
                    "internal: a batch's transaction does not fit its procedure",
                ));
            }
        }
        let Some((last, _, _)) = txns.last() else {
            return Ok(Vec::new());
        };
        // The watermark and the publisher's origins are the batch's (one
        // watermark per batch, as for a group); each timestamp is its own.
        let [peers, _, wm_ids, wm_ts] = self.guard_params(last).params(false);
        let mut params = vec![
            Param::text(self.origin.clone()),
            Param::text(self.next_expected.to_string()),
            peers,
            wm_ids,
            wm_ts,
            Param::lsn_array(&txns.iter().map(|t| t.0.end_lsn.0).collect::<Vec<_>>()),
            Param::timestamptz_array(&txns.iter().map(|t| t.0.commit_ts.0).collect::<Vec<_>>()),
        ];
        params.extend(columns.iter().map(|c| Param::nullable_text_array(c)));
        Ok(params)
    }

    /// Sends a batch held in the group (`group.rs`) as one CALL; each
    /// transaction alone instead when the session has no procedure for it.
    pub(super) async fn send_batch(
        &mut self,
        shape: Shape,
        txns: Vec<Held>,
    ) -> Result<(), ApplyFailure> {
        // Right after a conflict (a batch held while it was being
        // recovered), or with a key that just conflicted, each goes its
        // own way (`apply_alone`: one at a time, hot keys to the careful
        // path or settled in place), as it would have without a batch:
        // sent whole, the batch would roll back at the hot key again.
        if self.streak > 0
            || (!self.hot.is_empty() && txns.iter().any(|(m, b, _)| self.hot_route(m, b).is_some()))
        {
            return self.send_each(txns).await;
        }
        let (def, display, arrays) = match self.batch_definition(&shape) {
            Ok(d) => d,
            Err(_) => return self.send_each(txns).await,
        };
        // Created at first use, which waits for everything in flight: a
        // conflict met there is recovered first (those transactions come
        // before this batch).
        let name = loop {
            let mut pipe = self.take_pipe()?;
            let r = pipe.procedure(&def, &display).await;
            self.pipe = Some(pipe);
            match r {
                Ok(n) => break n,
                Err(f) if f.conflict => Box::pin(self.recover(f)).await?,
                Err(f) => return Err(f),
            }
        };
        // A conflict recovered meanwhile started a streak: each alone.
        let Some(name) = name.filter(|_| self.streak == 0) else {
            return self.send_each(txns).await;
        };
        let params = match self.batch_params(&shape, &txns, arrays) {
            Ok(p) => p,
            // A value that cannot go (a column the publisher did not send,
            // ...): the fast path names it, transaction by transaction.
            Err(_) => return self.send_each(txns).await,
        };
        let mut pipe = self.take_pipe()?;
        let stmt = pipe
            .prepare(&self.stmt_names, &display, &sql::batch_call(&name, arrays))
            .await;
        self.pipe = Some(pipe);
        let call = Call {
            stmt: stmt?,
            params,
            display,
        };
        self.send_held(txns, Some(call)).await
    }

    /// Each transaction as it would have gone without a batch.
    async fn send_each(&mut self, txns: Vec<Held>) -> Result<(), ApplyFailure> {
        for (meta, body, _) in txns {
            Box::pin(self.apply_alone(&meta, body)).await?;
        }
        Ok(())
    }
}
