//! A remote transaction as the applier sees it: its identity (`TxnMeta`)
//! and its changes (`TxnBody`), which can be read again from the start
//! (`Replayable`): a conflict applies a transaction a second time, with
//! the resolver, and a transaction may sit in memory or in a spool file.

use std::sync::Arc;

use mm_proto::Lsn;
use mm_proto::pgoutput::{Message, PgTimestamp};

use super::ApplyFailure;
use super::applier::is_partition_truncate;

/// Identity of the remote transaction being applied.
#[derive(Debug, Clone, Copy)]
pub struct TxnMeta {
    pub xid: u32,
    pub commit_lsn: Lsn,
    /// Stored as the applied progress: START_REPLICATION resumes from it.
    pub end_lsn: Lsn,
    pub commit_ts: PgTimestamp,
}

impl TxnMeta {
    /// A streamed transaction applied before its STREAM COMMIT arrived
    /// (`early.rs`): its commit LSN, end and timestamp are not known yet.
    /// The timestamp stands at `-infinity`, which makes every fast-path
    /// check that compares it conservative: an older local version from
    /// another origin is never taken as routine (`mm.routine`), any
    /// truncate but the publisher's own counts as newer
    /// (`mm.insert_recheck`); such a change is
    /// sent to the resolver, at the commit, with the real timestamp.
    pub fn streaming(xid: u32) -> TxnMeta {
        TxnMeta {
            xid,
            commit_lsn: Lsn::INVALID,
            end_lsn: Lsn::INVALID,
            commit_ts: PgTimestamp::NEG_INFINITY,
        }
    }

    /// False while a streamed transaction is applied before its commit.
    pub fn commit_known(&self) -> bool {
        self.commit_ts != PgTimestamp::NEG_INFINITY
    }
}

/// Where a transaction's messages come from: memory for ordinary transactions,
/// the spool file for streamed ones.
pub trait ChangeSource: Send {
    fn next_message(&mut self) -> Result<Option<Message>, ApplyFailure>;
}

impl ChangeSource for std::vec::IntoIter<Message> {
    fn next_message(&mut self) -> Result<Option<Message>, ApplyFailure> {
        Ok(self.next())
    }
}

/// A transaction's changes, readable again: a transaction that meets a
/// conflict on the fast path is rolled back and applied once more with the
/// resolver, and so are the ones pipelined behind it.
pub trait Replayable: Send + Sync {
    fn open(&self) -> Result<Box<dyn ChangeSource>, ApplyFailure>;

    /// The transaction's change when it is its only one (a row insert,
    /// update or delete, with no RELATION message before it): such a
    /// transaction is applied as one statement (`sql::Commit::Fused`).
    fn single_change(&self) -> Option<Message> {
        None
    }

    /// Every message, when the transaction is held in memory: what an
    /// apply lane's scheduler reads its write set from (`lanes.rs`).
    fn messages(&self) -> Option<Arc<Vec<Message>>> {
        None
    }
}

/// A transaction received whole, kept in memory until it commits here.
pub struct InMemory(pub Arc<Vec<Message>>);

struct InMemoryReader {
    msgs: Arc<Vec<Message>>,
    next: usize,
}

impl ChangeSource for InMemoryReader {
    /// Clones one message at a time (its values are shared `Bytes`), never
    /// the whole transaction.
    fn next_message(&mut self) -> Result<Option<Message>, ApplyFailure> {
        let m = self.msgs.get(self.next).cloned();
        self.next += 1;
        Ok(m)
    }
}

impl Replayable for InMemory {
    fn open(&self) -> Result<Box<dyn ChangeSource>, ApplyFailure> {
        Ok(Box::new(InMemoryReader {
            msgs: Arc::clone(&self.0),
            next: 0,
        }))
    }

    fn single_change(&self) -> Option<Message> {
        let mut change = None;
        for m in self.0.iter() {
            match m {
                Message::Insert(_) | Message::Update(_) | Message::Delete(_)
                    if change.is_none() =>
                {
                    change = Some(m)
                }
                Message::Message(msg) if is_partition_truncate(msg) => return None,
                // Nothing to apply (see `queue`).
                Message::Type(_) | Message::Message(_) | Message::Origin(_) => {}
                _ => return None,
            }
        }
        change.cloned()
    }

    fn messages(&self) -> Option<Arc<Vec<Message>>> {
        Some(Arc::clone(&self.0))
    }
}

pub type TxnBody = Arc<dyn Replayable>;
