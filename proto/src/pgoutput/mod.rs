//! pgoutput: PostgreSQL's logical replication message format, protocol
//! versions 1 to 4, decode and encode (sans-I/O).
//!
//! Reference: PostgreSQL docs "Logical Replication Message Formats" and
//! `src/backend/replication/logical/proto.c`. Verified against real
//! PostgreSQL 18 output captured by `proto/fuzz/capture-pg18.sh`
//! (`proto/fuzz/captures/`).
//!
//! The format is not self-describing: whether a data message starts with an
//! xid, and whether STREAM ABORT carries an LSN and timestamp, depends on
//! what was negotiated and on the preceding messages. [`decode`] therefore
//! takes a [`DecodeContext`]; [`StreamTracker`] maintains it across a stream.
//!
//! ```
//! use bytes::Bytes;
//! use mm_proto::pgoutput::{Message, StreamTracker};
//!
//! let mut tracker = StreamTracker::new(4, false);
//! // STREAM START of xid 0x312, first segment; then an INSERT inside it.
//! let start = Bytes::from_static(b"S\x00\x00\x03\x12\x01");
//! assert!(matches!(tracker.decode(start), Ok(Message::StreamStart(_))));
//! let insert = Bytes::from_static(b"I\x00\x00\x03\x12\x00\x00\x40\x1cN\x00\x01t\x00\x00\x00\x0242");
//! let Ok(Message::Insert(insert)) = tracker.decode(insert) else { panic!() };
//! assert_eq!(insert.xid, Some(0x312));
//! ```

mod decode;
mod encode;
mod error;
pub mod framed;
mod message;
pub mod oracle;
mod timestamp;
mod tuple;

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests;

pub use decode::decode;
pub use encode::{encode, encode_to_bytes};
pub use error::{ContextViolation, DecodeError, EncodeError, InvalidContext};
pub use framed::{FrameError, FramedReader, read_framed, write_framed};
pub use message::{
    Begin, BeginPrepare, Commit, CommitPrepared, Delete, Insert, LogicalMessage, Message, Origin,
    Prepare, Relation, RelationColumn, ReplicaIdentity, RollbackPrepared, StreamAbort,
    StreamAbortInfo, StreamCommit, StreamPrepare, StreamStart, Truncate, TypeMessage, Update, tag,
    tag_name,
};
pub use timestamp::{PgTimestamp, TimestampOutOfRange};
pub use tuple::{ColumnValue, KeyTuple, KeyTupleMismatch, KeyValue, OldTuple, TupleData};

use bytes::{Bytes, BytesMut};

/// Highest pgoutput protocol version this codec implements.
pub const MAX_PROTOCOL_VERSION: u8 = 4;

/// What the decoder must know about the session to parse a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DecodeContext {
    /// The negotiated `proto_version` (1..=4).
    pub protocol_version: u8,
    /// Between STREAM START and STREAM STOP: data messages carry an xid prefix.
    pub in_stream_block: bool,
    /// `streaming 'parallel'` was requested (protocol >= 4): STREAM ABORT
    /// then carries the abort LSN and timestamp.
    pub parallel_streaming: bool,
}

impl DecodeContext {
    /// Outside any stream block, streaming not parallel.
    pub const fn new(protocol_version: u8) -> Self {
        DecodeContext {
            protocol_version,
            in_stream_block: false,
            parallel_streaming: false,
        }
    }

    /// Rejects combinations no PostgreSQL session produces, so a caller's
    /// misconfiguration fails loudly instead of misparsing the stream.
    pub fn validate(&self) -> Result<(), InvalidContext> {
        let v = self.protocol_version;
        if !(1..=MAX_PROTOCOL_VERSION).contains(&v) {
            return Err(InvalidContext::UnsupportedProtocolVersion(v));
        }
        if self.in_stream_block && v < 2 {
            return Err(InvalidContext::StreamingNeedsV2(v));
        }
        if self.parallel_streaming && v < 4 {
            return Err(InvalidContext::ParallelNeedsV4(v));
        }
        Ok(())
    }

    /// STREAM ABORT carries abort LSN/timestamp (PostgreSQL's `write_abort_info`).
    pub fn abort_info_expected(&self) -> bool {
        self.protocol_version >= 4 && self.parallel_streaming
    }
}

/// Where each message type may appear: enforced identically by decode and
/// encode (so encoding only produces what decoding accepts).
///
/// Versions: streaming messages arrived in protocol 2, two-phase in 3.
/// Stream blocks hold only data messages (and ORIGIN, which
/// pgoutput_stream_start sends right after STREAM START); every transaction
/// boundary message comes outside them.
pub(crate) fn check_message_allowed(tag: u8, ctx: &DecodeContext) -> Result<(), ContextViolation> {
    let min_version = match tag {
        tag::STREAM_START | tag::STREAM_STOP | tag::STREAM_COMMIT | tag::STREAM_ABORT => 2,
        tag::BEGIN_PREPARE
        | tag::PREPARE
        | tag::COMMIT_PREPARED
        | tag::ROLLBACK_PREPARED
        | tag::STREAM_PREPARE => 3,
        _ => 1,
    };
    if ctx.protocol_version < min_version {
        return Err(ContextViolation::RequiresProtocol {
            min: min_version,
            negotiated: ctx.protocol_version,
        });
    }
    match tag {
        tag::ORIGIN
        | tag::RELATION
        | tag::TYPE
        | tag::INSERT
        | tag::UPDATE
        | tag::DELETE
        | tag::TRUNCATE
        | tag::MESSAGE => Ok(()),
        tag::STREAM_STOP if !ctx.in_stream_block => Err(ContextViolation::OutsideStreamBlock),
        tag::STREAM_STOP => Ok(()),
        _ if ctx.in_stream_block => Err(ContextViolation::InsideStreamBlock),
        _ => Ok(()),
    }
}

/// Decodes a whole replication stream in order, keeping the
/// [`DecodeContext`] in step: enters the stream block on STREAM START and
/// leaves it on STREAM STOP. A message that fails to decode leaves the state
/// unchanged.
#[derive(Debug, Clone)]
pub struct StreamTracker {
    ctx: DecodeContext,
    /// Invariant: `Some` exactly when `ctx.in_stream_block`.
    stream_xid: Option<u32>,
}

impl StreamTracker {
    /// For a session started with `proto_version` and, if
    /// `parallel_streaming`, `streaming 'parallel'`.
    pub fn new(protocol_version: u8, parallel_streaming: bool) -> Self {
        StreamTracker {
            ctx: DecodeContext {
                protocol_version,
                in_stream_block: false,
                parallel_streaming,
            },
            stream_xid: None,
        }
    }

    /// The context the next message will be decoded with.
    pub fn context(&self) -> DecodeContext {
        self.ctx
    }

    /// The xid of the STREAM START we are inside, if any.
    pub fn stream_xid(&self) -> Option<u32> {
        self.stream_xid
    }

    pub fn decode(&mut self, buf: Bytes) -> Result<Message, DecodeError> {
        let msg = decode(buf, &self.ctx)?;
        self.observe(&msg);
        Ok(msg)
    }

    /// The sending side of the same state machine (for producing test streams).
    pub fn encode(&mut self, msg: &Message, out: &mut BytesMut) -> Result<(), EncodeError> {
        encode(msg, &self.ctx, out)?;
        self.observe(msg);
        Ok(())
    }

    fn observe(&mut self, msg: &Message) {
        match msg {
            Message::StreamStart(s) => {
                self.ctx.in_stream_block = true;
                self.stream_xid = Some(s.xid);
            }
            Message::StreamStop => {
                self.ctx.in_stream_block = false;
                self.stream_xid = None;
            }
            _ => {}
        }
    }
}
