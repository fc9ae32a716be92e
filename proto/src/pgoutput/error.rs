//! Errors of the pgoutput codec.

use std::fmt;

use super::DecodeContext;

/// Why a byte string is not a valid pgoutput message in its context.
///
/// Offsets count from the message type byte (offset 0).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error(
        "pgoutput message truncated: {what} needs {needed} bytes at offset {offset}, {available} left"
    )]
    Truncated {
        what: &'static str,
        offset: usize,
        needed: usize,
        available: usize,
    },
    #[error("pgoutput message truncated: {what} at offset {offset} has no NUL terminator")]
    UnterminatedString { what: &'static str, offset: usize },
    #[error("{what} at offset {offset} is not valid UTF-8")]
    InvalidUtf8 { what: &'static str, offset: usize },
    #[error("unknown pgoutput message type byte 0x{tag:02x}")]
    UnknownMessageType { tag: u8 },
    #[error("unexpected tuple marker 0x{found:02x} at offset {offset}: expected {expected}")]
    UnexpectedTupleMarker {
        offset: usize,
        found: u8,
        expected: &'static str,
    },
    #[error("unknown column kind 0x{kind:02x} at offset {offset}: expected 'n', 'u', 't' or 'b'")]
    UnknownColumnKind { offset: usize, kind: u8 },
    #[error("invalid {what} {value:#x} at offset {offset}")]
    InvalidField {
        what: &'static str,
        offset: usize,
        value: u64,
    },
    #[error("{what} {count} at offset {offset} cannot fit in the {available} bytes left")]
    CountTooLarge {
        what: &'static str,
        offset: usize,
        count: u64,
        available: usize,
    },
    #[error("{count} trailing bytes after a complete {message} message, at offset {offset}")]
    TrailingBytes {
        message: &'static str,
        offset: usize,
        count: usize,
    },
    #[error("{message} message not expected here: {violation}")]
    UnexpectedMessage {
        message: &'static str,
        violation: ContextViolation,
    },
    #[error(transparent)]
    InvalidContext(#[from] InvalidContext),
}

/// Why a [`Message`](super::Message) cannot be encoded in a context.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    #[error("{message} message cannot be sent here: {violation}")]
    UnexpectedMessage {
        message: &'static str,
        violation: ContextViolation,
    },
    #[error(
        "{message} message has xid {xid:?} but the context is {}in a stream block: data messages carry an xid exactly inside stream blocks",
        if *in_stream_block { "" } else { "not " }
    )]
    XidMismatch {
        message: &'static str,
        xid: Option<u32>,
        in_stream_block: bool,
    },
    #[error(
        "STREAM ABORT abort_info must be present exactly when protocol >= 4 and streaming is parallel (context {ctx:?})"
    )]
    AbortInfoMismatch { ctx: DecodeContext },
    #[error("{what} contains a NUL byte; pgoutput strings are NUL-terminated")]
    NulInString { what: &'static str },
    #[error("{what} {count} exceeds the wire format's maximum {max}")]
    TooLarge {
        what: &'static str,
        count: u64,
        max: u64,
    },
    #[error(transparent)]
    InvalidContext(#[from] InvalidContext),
}

/// A message type that PostgreSQL never sends in the given context.
///
/// Enforced on decode because the context decides how the rest of the stream
/// is parsed (an xid prefix or not): a STREAM STOP outside a stream block, or
/// a BEGIN inside one, means the caller's idea of the stream state is wrong,
/// and continuing would misread every following data message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContextViolation {
    /// The message type exists only from protocol version `min`.
    RequiresProtocol { min: u8, negotiated: u8 },
    /// Sent only outside stream blocks, but we are between STREAM START and STOP.
    InsideStreamBlock,
    /// STREAM STOP without a preceding STREAM START.
    OutsideStreamBlock,
}

impl fmt::Display for ContextViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ContextViolation::RequiresProtocol { min, negotiated } => write!(
                f,
                "requires protocol version {min}, negotiated {negotiated}"
            ),
            ContextViolation::InsideStreamBlock => {
                f.write_str("not allowed between STREAM START and STREAM STOP")
            }
            ContextViolation::OutsideStreamBlock => {
                f.write_str("only allowed between STREAM START and STREAM STOP")
            }
        }
    }
}

/// A [`DecodeContext`] no PostgreSQL session can produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum InvalidContext {
    #[error("unsupported pgoutput protocol version {0} (supported: 1 to 4)")]
    UnsupportedProtocolVersion(u8),
    #[error("stream blocks need protocol version 2 or later, negotiated {0}")]
    StreamingNeedsV2(u8),
    #[error("parallel streaming needs protocol version 4 or later, negotiated {0}")]
    ParallelNeedsV4(u8),
}
