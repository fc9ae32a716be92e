//! pgoutput message decoding.
//!
//! Every read goes through [`Reader`], which bounds-checks with `get` and
//! never does unchecked arithmetic on input-derived numbers: malformed input
//! (truncated, garbage, hostile) yields a [`DecodeError`], never a panic, and
//! never an allocation larger than the input itself.

use bytes::Bytes;

use super::error::DecodeError;
use super::message::*;
use super::tuple::{ColumnValue, KeyTuple, OldTuple, TupleData};
use super::{DecodeContext, PgTimestamp, check_message_allowed};
use crate::Lsn;

/// Decodes one pgoutput message (the payload of an XLogData 'w' frame).
///
/// Column values and logical message contents are slices of `buf` (no copy).
/// `ctx` must describe the session: the negotiated protocol version and
/// streaming mode, and whether the previous messages opened a stream block
/// (see [`StreamTracker`](super::StreamTracker), which tracks that for you).
pub fn decode(buf: Bytes, ctx: &DecodeContext) -> Result<Message, DecodeError> {
    ctx.validate()?;
    let mut r = Reader { buf: &buf, pos: 0 };
    let tag = r.u8("message type")?;
    let name = tag_name(tag).ok_or(DecodeError::UnknownMessageType { tag })?;
    check_message_allowed(tag, ctx).map_err(|violation| DecodeError::UnexpectedMessage {
        message: name,
        violation,
    })?;
    let msg = match tag {
        tag::BEGIN => Message::Begin(Begin {
            final_lsn: r.lsn("final LSN")?,
            commit_timestamp: r.timestamp("commit timestamp")?,
            xid: r.u32("xid")?,
        }),
        tag::COMMIT => {
            r.zero_flags("COMMIT flags")?;
            Message::Commit(Commit {
                commit_lsn: r.lsn("commit LSN")?,
                end_lsn: r.lsn("end LSN")?,
                commit_timestamp: r.timestamp("commit timestamp")?,
            })
        }
        tag::ORIGIN => Message::Origin(Origin {
            commit_lsn: r.lsn("origin commit LSN")?,
            name: r.string("origin name")?,
        }),
        tag::RELATION => {
            let xid = r.stream_xid(ctx)?;
            let oid = r.u32("relation OID")?;
            let namespace = r.string("namespace")?;
            let name = r.string("relation name")?;
            let at = r.pos;
            let identity = r.u8("replica identity")?;
            let replica_identity =
                ReplicaIdentity::from_byte(identity).ok_or(DecodeError::InvalidField {
                    what: "replica identity",
                    offset: at,
                    value: identity.into(),
                })?;
            let columns = r.relation_columns()?;
            Message::Relation(Relation {
                xid,
                oid,
                namespace,
                name,
                replica_identity,
                columns,
            })
        }
        tag::TYPE => Message::Type(TypeMessage {
            xid: r.stream_xid(ctx)?,
            oid: r.u32("type OID")?,
            namespace: r.string("type namespace")?,
            name: r.string("type name")?,
        }),
        tag::INSERT => {
            let xid = r.stream_xid(ctx)?;
            let relation_oid = r.u32("relation OID")?;
            r.expect_marker(b'N', "'N'")?;
            Message::Insert(Insert {
                xid,
                relation_oid,
                new: r.tuple()?,
            })
        }
        tag::UPDATE => {
            let xid = r.stream_xid(ctx)?;
            let relation_oid = r.u32("relation OID")?;
            let at = r.pos;
            let old = match r.u8("tuple marker")? {
                b'K' => Some(OldTuple::Key(KeyTuple::from_wire(r.tuple()?))),
                b'O' => Some(OldTuple::Full(r.tuple()?)),
                b'N' => None,
                found => {
                    return Err(DecodeError::UnexpectedTupleMarker {
                        offset: at,
                        found,
                        expected: "'K', 'O' or 'N'",
                    });
                }
            };
            if old.is_some() {
                r.expect_marker(b'N', "'N'")?;
            }
            Message::Update(Update {
                xid,
                relation_oid,
                old,
                new: r.tuple()?,
            })
        }
        tag::DELETE => {
            let xid = r.stream_xid(ctx)?;
            let relation_oid = r.u32("relation OID")?;
            let at = r.pos;
            let old = match r.u8("tuple marker")? {
                b'K' => OldTuple::Key(KeyTuple::from_wire(r.tuple()?)),
                b'O' => OldTuple::Full(r.tuple()?),
                found => {
                    return Err(DecodeError::UnexpectedTupleMarker {
                        offset: at,
                        found,
                        expected: "'K' or 'O'",
                    });
                }
            };
            Message::Delete(Delete {
                xid,
                relation_oid,
                old,
            })
        }
        tag::TRUNCATE => {
            let xid = r.stream_xid(ctx)?;
            let count_at = r.pos;
            let count = r.u32("relation count")?;
            let flags_at = r.pos;
            let flags = r.u8("TRUNCATE options")?;
            if flags & !(TRUNCATE_CASCADE | TRUNCATE_RESTART_IDENTITY) != 0 {
                return Err(DecodeError::InvalidField {
                    what: "TRUNCATE options",
                    offset: flags_at,
                    value: flags.into(),
                });
            }
            let count = r.bounded_count(count.into(), 4, "relation count", count_at)?;
            let mut relation_oids = Vec::with_capacity(count);
            for _ in 0..count {
                relation_oids.push(r.u32("truncated relation OID")?);
            }
            Message::Truncate(Truncate {
                xid,
                cascade: flags & TRUNCATE_CASCADE != 0,
                restart_identity: flags & TRUNCATE_RESTART_IDENTITY != 0,
                relation_oids,
            })
        }
        tag::MESSAGE => {
            let xid = r.stream_xid(ctx)?;
            let transactional = r.bool_flag("MESSAGE flags")?;
            let lsn = r.lsn("message LSN")?;
            let prefix = r.string("message prefix")?;
            let len = r.u32("message length")?;
            Message::Message(LogicalMessage {
                xid,
                transactional,
                lsn,
                prefix,
                content: r.bytes(len, "message content")?,
            })
        }
        tag::STREAM_START => Message::StreamStart(StreamStart {
            xid: r.u32("xid")?,
            first_segment: r.bool_flag("first segment flag")?,
        }),
        tag::STREAM_STOP => Message::StreamStop,
        tag::STREAM_COMMIT => {
            let xid = r.u32("xid")?;
            r.zero_flags("STREAM COMMIT flags")?;
            Message::StreamCommit(StreamCommit {
                xid,
                commit_lsn: r.lsn("commit LSN")?,
                end_lsn: r.lsn("end LSN")?,
                commit_timestamp: r.timestamp("commit timestamp")?,
            })
        }
        tag::STREAM_ABORT => Message::StreamAbort(StreamAbort {
            xid: r.u32("xid")?,
            subtransaction_xid: r.u32("subtransaction xid")?,
            abort_info: if ctx.abort_info_expected() {
                Some(StreamAbortInfo {
                    abort_lsn: r.lsn("abort LSN")?,
                    abort_timestamp: r.timestamp("abort timestamp")?,
                })
            } else {
                None
            },
        }),
        tag::BEGIN_PREPARE => Message::BeginPrepare(BeginPrepare {
            prepare_lsn: r.lsn("prepare LSN")?,
            end_lsn: r.lsn("end LSN")?,
            prepare_timestamp: r.timestamp("prepare timestamp")?,
            xid: r.u32("xid")?,
            gid: r.string("GID")?,
        }),
        tag::PREPARE => {
            r.zero_flags("PREPARE flags")?;
            Message::Prepare(Prepare {
                prepare_lsn: r.lsn("prepare LSN")?,
                end_lsn: r.lsn("end LSN")?,
                prepare_timestamp: r.timestamp("prepare timestamp")?,
                xid: r.u32("xid")?,
                gid: r.string("GID")?,
            })
        }
        tag::COMMIT_PREPARED => {
            r.zero_flags("COMMIT PREPARED flags")?;
            Message::CommitPrepared(CommitPrepared {
                commit_lsn: r.lsn("commit LSN")?,
                end_lsn: r.lsn("end LSN")?,
                commit_timestamp: r.timestamp("commit timestamp")?,
                xid: r.u32("xid")?,
                gid: r.string("GID")?,
            })
        }
        tag::ROLLBACK_PREPARED => {
            r.zero_flags("ROLLBACK PREPARED flags")?;
            Message::RollbackPrepared(RollbackPrepared {
                prepare_end_lsn: r.lsn("prepare end LSN")?,
                rollback_end_lsn: r.lsn("rollback end LSN")?,
                prepare_timestamp: r.timestamp("prepare timestamp")?,
                rollback_timestamp: r.timestamp("rollback timestamp")?,
                xid: r.u32("xid")?,
                gid: r.string("GID")?,
            })
        }
        tag::STREAM_PREPARE => {
            r.zero_flags("STREAM PREPARE flags")?;
            Message::StreamPrepare(StreamPrepare {
                prepare_lsn: r.lsn("prepare LSN")?,
                end_lsn: r.lsn("end LSN")?,
                prepare_timestamp: r.timestamp("prepare timestamp")?,
                xid: r.u32("xid")?,
                gid: r.string("GID")?,
            })
        }
        // tag_name() above accepted exactly the tags matched here.
        other => return Err(DecodeError::UnknownMessageType { tag: other }),
    };
    r.finish(name)?;
    Ok(msg)
}

pub(crate) const TRUNCATE_CASCADE: u8 = 1;
pub(crate) const TRUNCATE_RESTART_IDENTITY: u8 = 2;
pub(crate) const COLUMN_IS_KEY: u8 = 1;

/// Smallest wire size of one RELATION column: flags, empty name's NUL, type OID, typmod.
const MIN_RELATION_COLUMN_LEN: usize = 1 + 1 + 4 + 4;

/// A cursor over one message.
///
/// Invariant: `pos <= buf.len()`; every method advances `pos` only past bytes
/// it has checked exist.
struct Reader<'a> {
    buf: &'a Bytes,
    pos: usize,
}

impl Reader<'_> {
    fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    fn take(&mut self, n: usize, what: &'static str) -> Result<&[u8], DecodeError> {
        let truncated = || DecodeError::Truncated {
            what,
            offset: self.pos,
            needed: n,
            available: self.remaining(),
        };
        let end = self.pos.checked_add(n).ok_or_else(truncated)?;
        let bytes = self.buf.get(self.pos..end).ok_or_else(truncated)?;
        self.pos = end;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], DecodeError> {
        let bytes = self.take(N, what)?;
        // `take` returned exactly N bytes.
        bytes.try_into().map_err(|_| DecodeError::Truncated {
            what,
            offset: self.pos,
            needed: N,
            available: 0,
        })
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        let pos = self.pos;
        match self.buf.get(pos) {
            Some(&b) => {
                self.pos = pos + 1;
                Ok(b)
            }
            None => Err(DecodeError::Truncated {
                what,
                offset: pos,
                needed: 1,
                available: 0,
            }),
        }
    }

    fn u16(&mut self, what: &'static str) -> Result<u16, DecodeError> {
        Ok(u16::from_be_bytes(self.array(what)?))
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.array(what)?))
    }

    fn i32(&mut self, what: &'static str) -> Result<i32, DecodeError> {
        Ok(i32::from_be_bytes(self.array(what)?))
    }

    fn lsn(&mut self, what: &'static str) -> Result<Lsn, DecodeError> {
        Ok(Lsn(u64::from_be_bytes(self.array(what)?)))
    }

    fn timestamp(&mut self, what: &'static str) -> Result<PgTimestamp, DecodeError> {
        Ok(PgTimestamp(i64::from_be_bytes(self.array(what)?)))
    }

    /// The xid prefix of data messages, present exactly inside stream blocks.
    fn stream_xid(&mut self, ctx: &DecodeContext) -> Result<Option<u32>, DecodeError> {
        if ctx.in_stream_block {
            Ok(Some(self.u32("streamed transaction xid")?))
        } else {
            Ok(None)
        }
    }

    /// A flags byte PostgreSQL documents as "currently unused (must be 0)".
    /// Rejecting other values keeps decode exactly invertible and surfaces
    /// a future protocol change instead of ignoring it.
    fn zero_flags(&mut self, what: &'static str) -> Result<(), DecodeError> {
        let at = self.pos;
        match self.u8(what)? {
            0 => Ok(()),
            v => Err(DecodeError::InvalidField {
                what,
                offset: at,
                value: v.into(),
            }),
        }
    }

    /// A byte that must be 0 or 1.
    fn bool_flag(&mut self, what: &'static str) -> Result<bool, DecodeError> {
        let at = self.pos;
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(DecodeError::InvalidField {
                what,
                offset: at,
                value: v.into(),
            }),
        }
    }

    fn expect_marker(&mut self, marker: u8, expected: &'static str) -> Result<(), DecodeError> {
        let at = self.pos;
        let found = self.u8("tuple marker")?;
        if found == marker {
            Ok(())
        } else {
            Err(DecodeError::UnexpectedTupleMarker {
                offset: at,
                found,
                expected,
            })
        }
    }

    /// A NUL-terminated UTF-8 string.
    fn string(&mut self, what: &'static str) -> Result<String, DecodeError> {
        let at = self.pos;
        let rest = self.buf.get(at..).unwrap_or_default();
        let len = rest
            .iter()
            .position(|&b| b == 0)
            .ok_or(DecodeError::UnterminatedString { what, offset: at })?;
        let bytes = rest.get(..len).unwrap_or_default();
        let s = std::str::from_utf8(bytes)
            .map_err(|_| DecodeError::InvalidUtf8 { what, offset: at })?
            .to_owned();
        // len < rest.len(): the NUL is inside `rest`.
        self.pos = at + len + 1;
        Ok(s)
    }

    /// A zero-copy slice of the next `len` bytes.
    fn bytes(&mut self, len: u32, what: &'static str) -> Result<Bytes, DecodeError> {
        let at = self.pos;
        let len = usize::try_from(len).map_err(|_| DecodeError::Truncated {
            what,
            offset: at,
            needed: usize::MAX,
            available: self.remaining(),
        })?;
        self.take(len, what)?;
        Ok(self.buf.slice(at..self.pos))
    }

    /// Validates an element count read from the wire against the bytes left
    /// (each element needs at least `min_len`), so `Vec::with_capacity(count)`
    /// is bounded by the input size, not by what the sender claims.
    fn bounded_count(
        &self,
        count: u64,
        min_len: usize,
        what: &'static str,
        offset: usize,
    ) -> Result<usize, DecodeError> {
        let available = self.remaining();
        let fits = usize::try_from(count).ok().filter(|&n| {
            n.checked_mul(min_len)
                .is_some_and(|total| total <= available)
        });
        fits.ok_or(DecodeError::CountTooLarge {
            what,
            offset,
            count,
            available,
        })
    }

    fn relation_columns(&mut self) -> Result<Vec<RelationColumn>, DecodeError> {
        let at = self.pos;
        let count = self.u16("column count")?;
        let count =
            self.bounded_count(count.into(), MIN_RELATION_COLUMN_LEN, "column count", at)?;
        let mut columns = Vec::with_capacity(count);
        for _ in 0..count {
            let flags_at = self.pos;
            let flags = self.u8("column flags")?;
            if flags & !COLUMN_IS_KEY != 0 {
                return Err(DecodeError::InvalidField {
                    what: "column flags",
                    offset: flags_at,
                    value: flags.into(),
                });
            }
            columns.push(RelationColumn {
                is_key: flags & COLUMN_IS_KEY != 0,
                name: self.string("column name")?,
                type_oid: self.u32("column type OID")?,
                type_modifier: self.i32("column type modifier")?,
            });
        }
        Ok(columns)
    }

    /// TupleData. The hot path: one Vec per row, one refcounted slice per value.
    fn tuple(&mut self) -> Result<TupleData, DecodeError> {
        let at = self.pos;
        let count = self.u16("tuple column count")?;
        // Every column takes at least its kind byte.
        let count = self.bounded_count(count.into(), 1, "tuple column count", at)?;
        let mut columns = Vec::with_capacity(count);
        for _ in 0..count {
            let kind_at = self.pos;
            columns.push(match self.u8("column kind")? {
                b'n' => ColumnValue::Null,
                b'u' => ColumnValue::UnchangedToast,
                b't' => {
                    let len = self.u32("text value length")?;
                    ColumnValue::Text(self.bytes(len, "text value")?)
                }
                b'b' => {
                    let len = self.u32("binary value length")?;
                    ColumnValue::Binary(self.bytes(len, "binary value")?)
                }
                kind => {
                    return Err(DecodeError::UnknownColumnKind {
                        offset: kind_at,
                        kind,
                    });
                }
            });
        }
        Ok(TupleData { columns })
    }

    fn finish(&self, message: &'static str) -> Result<(), DecodeError> {
        match self.remaining() {
            0 => Ok(()),
            count => Err(DecodeError::TrailingBytes {
                message,
                offset: self.pos,
                count,
            }),
        }
    }
}
