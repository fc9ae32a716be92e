//! The pgoutput logical replication messages, one struct per message type.
//!
//! Field names follow PostgreSQL's "Logical Replication Message Formats"
//! documentation. Strings are validated UTF-8; column values and logical
//! message payloads are `Bytes` slices sharing the received buffer.

use bytes::Bytes;

use super::PgTimestamp;
use super::tuple::{OldTuple, TupleData};
use crate::Lsn;

/// One pgoutput message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Begin(Begin),
    Commit(Commit),
    Origin(Origin),
    Relation(Relation),
    Type(TypeMessage),
    Insert(Insert),
    Update(Update),
    Delete(Delete),
    Truncate(Truncate),
    Message(LogicalMessage),
    StreamStart(StreamStart),
    StreamStop,
    StreamCommit(StreamCommit),
    StreamAbort(StreamAbort),
    BeginPrepare(BeginPrepare),
    Prepare(Prepare),
    CommitPrepared(CommitPrepared),
    RollbackPrepared(RollbackPrepared),
    StreamPrepare(StreamPrepare),
}

/// The message type bytes (first byte of every message).
pub mod tag {
    pub const BEGIN: u8 = b'B';
    pub const COMMIT: u8 = b'C';
    pub const ORIGIN: u8 = b'O';
    pub const RELATION: u8 = b'R';
    pub const TYPE: u8 = b'Y';
    pub const INSERT: u8 = b'I';
    pub const UPDATE: u8 = b'U';
    pub const DELETE: u8 = b'D';
    pub const TRUNCATE: u8 = b'T';
    pub const MESSAGE: u8 = b'M';
    pub const STREAM_START: u8 = b'S';
    pub const STREAM_STOP: u8 = b'E';
    pub const STREAM_COMMIT: u8 = b'c';
    pub const STREAM_ABORT: u8 = b'A';
    pub const BEGIN_PREPARE: u8 = b'b';
    pub const PREPARE: u8 = b'P';
    pub const COMMIT_PREPARED: u8 = b'K';
    pub const ROLLBACK_PREPARED: u8 = b'r';
    pub const STREAM_PREPARE: u8 = b'p';
}

impl Message {
    /// The message type byte.
    pub fn tag(&self) -> u8 {
        match self {
            Message::Begin(_) => tag::BEGIN,
            Message::Commit(_) => tag::COMMIT,
            Message::Origin(_) => tag::ORIGIN,
            Message::Relation(_) => tag::RELATION,
            Message::Type(_) => tag::TYPE,
            Message::Insert(_) => tag::INSERT,
            Message::Update(_) => tag::UPDATE,
            Message::Delete(_) => tag::DELETE,
            Message::Truncate(_) => tag::TRUNCATE,
            Message::Message(_) => tag::MESSAGE,
            Message::StreamStart(_) => tag::STREAM_START,
            Message::StreamStop => tag::STREAM_STOP,
            Message::StreamCommit(_) => tag::STREAM_COMMIT,
            Message::StreamAbort(_) => tag::STREAM_ABORT,
            Message::BeginPrepare(_) => tag::BEGIN_PREPARE,
            Message::Prepare(_) => tag::PREPARE,
            Message::CommitPrepared(_) => tag::COMMIT_PREPARED,
            Message::RollbackPrepared(_) => tag::ROLLBACK_PREPARED,
            Message::StreamPrepare(_) => tag::STREAM_PREPARE,
        }
    }

    /// A short human-readable name for logs and errors ("INSERT", "STREAM COMMIT").
    pub fn name(&self) -> &'static str {
        tag_name(self.tag()).unwrap_or("UNKNOWN")
    }

    /// The streamed transaction's xid carried by data messages inside a
    /// stream block; `None` outside stream blocks and for control messages.
    pub fn stream_xid(&self) -> Option<u32> {
        match self {
            Message::Relation(m) => m.xid,
            Message::Type(m) => m.xid,
            Message::Insert(m) => m.xid,
            Message::Update(m) => m.xid,
            Message::Delete(m) => m.xid,
            Message::Truncate(m) => m.xid,
            Message::Message(m) => m.xid,
            _ => None,
        }
    }
}

/// The documented name of a message type byte, `None` if pgoutput has no such message.
pub fn tag_name(tag: u8) -> Option<&'static str> {
    Some(match tag {
        tag::BEGIN => "BEGIN",
        tag::COMMIT => "COMMIT",
        tag::ORIGIN => "ORIGIN",
        tag::RELATION => "RELATION",
        tag::TYPE => "TYPE",
        tag::INSERT => "INSERT",
        tag::UPDATE => "UPDATE",
        tag::DELETE => "DELETE",
        tag::TRUNCATE => "TRUNCATE",
        tag::MESSAGE => "MESSAGE",
        tag::STREAM_START => "STREAM START",
        tag::STREAM_STOP => "STREAM STOP",
        tag::STREAM_COMMIT => "STREAM COMMIT",
        tag::STREAM_ABORT => "STREAM ABORT",
        tag::BEGIN_PREPARE => "BEGIN PREPARE",
        tag::PREPARE => "PREPARE",
        tag::COMMIT_PREPARED => "COMMIT PREPARED",
        tag::ROLLBACK_PREPARED => "ROLLBACK PREPARED",
        tag::STREAM_PREPARE => "STREAM PREPARE",
        _ => return None,
    })
}

/// 'B': start of a (non-streamed) transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Begin {
    /// LSN of the commit record: the transaction's position for origin progress.
    pub final_lsn: Lsn,
    pub commit_timestamp: PgTimestamp,
    pub xid: u32,
}

/// 'C': end of a transaction started by [`Begin`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Commit {
    pub commit_lsn: Lsn,
    /// End of the commit record: where a restart must resume.
    pub end_lsn: Lsn,
    pub commit_timestamp: PgTimestamp,
}

/// 'O': the transaction was applied on the publisher from another origin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    /// The commit LSN on the origin server.
    pub commit_lsn: Lsn,
    pub name: String,
}

/// REPLICA IDENTITY of a published table: which old values UPDATE/DELETE carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReplicaIdentity {
    /// 'd': primary key columns.
    Default,
    /// 'n': nothing; UPDATE/DELETE cannot be published.
    Nothing,
    /// 'f': all columns, sent as an 'O' old tuple.
    Full,
    /// 'i': the columns of a chosen unique index.
    Index,
}

impl ReplicaIdentity {
    pub fn as_byte(self) -> u8 {
        match self {
            ReplicaIdentity::Default => b'd',
            ReplicaIdentity::Nothing => b'n',
            ReplicaIdentity::Full => b'f',
            ReplicaIdentity::Index => b'i',
        }
    }

    pub fn from_byte(b: u8) -> Option<Self> {
        match b {
            b'd' => Some(ReplicaIdentity::Default),
            b'n' => Some(ReplicaIdentity::Nothing),
            b'f' => Some(ReplicaIdentity::Full),
            b'i' => Some(ReplicaIdentity::Index),
            _ => None,
        }
    }
}

/// 'R': describes a published table. Sent before the first change to it in a
/// session (and again after its definition changes); row messages refer to it
/// by `oid` and carry one value per entry of `columns`, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    /// Some only inside a stream block.
    pub xid: Option<u32>,
    pub oid: u32,
    /// Schema name; PostgreSQL sends an empty string for `pg_catalog`.
    pub namespace: String,
    pub name: String,
    pub replica_identity: ReplicaIdentity,
    pub columns: Vec<RelationColumn>,
}

/// One column as published: dropped columns are never sent, generated ones
/// only with `publish_generated_columns`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelationColumn {
    /// Part of the replica identity (flags bit 1). With REPLICA IDENTITY FULL
    /// every column is marked.
    pub is_key: bool,
    pub name: String,
    pub type_oid: u32,
    /// `atttypmod`, -1 when the type has none.
    pub type_modifier: i32,
}

/// 'Y': names a non-built-in type (by OID) used by a later RELATION.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TypeMessage {
    /// Some only inside a stream block.
    pub xid: Option<u32>,
    pub oid: u32,
    /// Schema name; empty for `pg_catalog`.
    pub namespace: String,
    pub name: String,
}

/// 'I'.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Insert {
    /// Some only inside a stream block.
    pub xid: Option<u32>,
    pub relation_oid: u32,
    pub new: TupleData,
}

/// 'U'.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Update {
    /// Some only inside a stream block.
    pub xid: Option<u32>,
    pub relation_oid: u32,
    /// The old key ('K', only when the key changed) or the whole old row
    /// ('O', REPLICA IDENTITY FULL); `None` when the key did not change.
    pub old: Option<OldTuple>,
    pub new: TupleData,
}

/// 'D'.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delete {
    /// Some only inside a stream block.
    pub xid: Option<u32>,
    pub relation_oid: u32,
    pub old: OldTuple,
}

/// 'T'.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Truncate {
    /// Some only inside a stream block.
    pub xid: Option<u32>,
    /// TRUNCATE ... CASCADE (option bit 1).
    pub cascade: bool,
    /// TRUNCATE ... RESTART IDENTITY (option bit 2).
    pub restart_identity: bool,
    pub relation_oids: Vec<u32>,
}

/// 'M': `pg_logical_emit_message()` output (sent when `messages 'true'`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogicalMessage {
    /// Some only inside a stream block.
    pub xid: Option<u32>,
    /// Part of a transaction (flags bit 1); otherwise sent immediately,
    /// outside any BEGIN/COMMIT, even if the emitting transaction aborts.
    pub transactional: bool,
    pub lsn: Lsn,
    pub prefix: String,
    pub content: Bytes,
}

/// 'S': the following messages (until STREAM STOP) belong to in-progress
/// transaction `xid`. Protocol >= 2.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamStart {
    pub xid: u32,
    /// The first block ever sent for this transaction.
    pub first_segment: bool,
}

/// 'c': a streamed transaction committed. Protocol >= 2.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamCommit {
    pub xid: u32,
    pub commit_lsn: Lsn,
    pub end_lsn: Lsn,
    pub commit_timestamp: PgTimestamp,
}

/// 'A': a streamed transaction (`subtransaction_xid == xid`) or one of its
/// subtransactions aborted. Protocol >= 2.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamAbort {
    pub xid: u32,
    pub subtransaction_xid: u32,
    /// Sent only with protocol >= 4 and `streaming 'parallel'`.
    pub abort_info: Option<StreamAbortInfo>,
}

/// Where and when a streamed (sub)transaction aborted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamAbortInfo {
    pub abort_lsn: Lsn,
    pub abort_timestamp: PgTimestamp,
}

/// 'b': start of a prepared transaction (two-phase, protocol >= 3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BeginPrepare {
    pub prepare_lsn: Lsn,
    /// End LSN of the prepared transaction.
    pub end_lsn: Lsn,
    pub prepare_timestamp: PgTimestamp,
    pub xid: u32,
    pub gid: String,
}

/// 'P': PREPARE TRANSACTION of a transaction started by [`BeginPrepare`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prepare {
    pub prepare_lsn: Lsn,
    pub end_lsn: Lsn,
    pub prepare_timestamp: PgTimestamp,
    pub xid: u32,
    pub gid: String,
}

/// 'K': COMMIT PREPARED.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitPrepared {
    pub commit_lsn: Lsn,
    pub end_lsn: Lsn,
    pub commit_timestamp: PgTimestamp,
    pub xid: u32,
    pub gid: String,
}

/// 'r': ROLLBACK PREPARED.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RollbackPrepared {
    pub prepare_end_lsn: Lsn,
    pub rollback_end_lsn: Lsn,
    pub prepare_timestamp: PgTimestamp,
    pub rollback_timestamp: PgTimestamp,
    pub xid: u32,
    pub gid: String,
}

/// 'p': PREPARE TRANSACTION of a streamed transaction (protocol >= 3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamPrepare {
    pub prepare_lsn: Lsn,
    pub end_lsn: Lsn,
    pub prepare_timestamp: PgTimestamp,
    pub xid: u32,
    pub gid: String,
}
