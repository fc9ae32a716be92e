//! pgoutput message encoding: the exact inverse of [`decode`](super::decode).
//!
//! Used to produce test traffic and fuzz oracles. It refuses anything
//! `decode` would refuse (wrong context, NUL inside a string, counts the wire
//! cannot express), so `decode(encode(m)) == m` for every `m` it accepts, and
//! the bytes are what PostgreSQL would send for the same message.

use bytes::{BufMut, Bytes, BytesMut};

use super::decode::{COLUMN_IS_KEY, TRUNCATE_CASCADE, TRUNCATE_RESTART_IDENTITY};
use super::error::EncodeError;
use super::message::*;
use super::tuple::{ColumnValue, OldTuple, TupleData};
use super::{DecodeContext, PgTimestamp, check_message_allowed};
use crate::Lsn;

/// Appends the encoding of `msg` for a session described by `ctx` to `out`.
/// On error `out` is left as it was.
pub fn encode(msg: &Message, ctx: &DecodeContext, out: &mut BytesMut) -> Result<(), EncodeError> {
    let start = out.len();
    let result = encode_inner(msg, ctx, out);
    if result.is_err() {
        out.truncate(start);
    }
    result
}

/// [`encode`] into a fresh buffer.
pub fn encode_to_bytes(msg: &Message, ctx: &DecodeContext) -> Result<Bytes, EncodeError> {
    let mut out = BytesMut::new();
    encode(msg, ctx, &mut out)?;
    Ok(out.freeze())
}

fn encode_inner(msg: &Message, ctx: &DecodeContext, out: &mut BytesMut) -> Result<(), EncodeError> {
    ctx.validate()?;
    check_message_allowed(msg.tag(), ctx).map_err(|violation| EncodeError::UnexpectedMessage {
        message: msg.name(),
        violation,
    })?;
    if let Some(xid) = data_message_xid(msg)
        && xid.is_some() != ctx.in_stream_block
    {
        return Err(EncodeError::XidMismatch {
            message: msg.name(),
            xid,
            in_stream_block: ctx.in_stream_block,
        });
    }
    out.put_u8(msg.tag());
    match msg {
        Message::Begin(m) => {
            put_lsn(out, m.final_lsn);
            put_ts(out, m.commit_timestamp);
            out.put_u32(m.xid);
        }
        Message::Commit(m) => {
            out.put_u8(0);
            put_lsn(out, m.commit_lsn);
            put_lsn(out, m.end_lsn);
            put_ts(out, m.commit_timestamp);
        }
        Message::Origin(m) => {
            put_lsn(out, m.commit_lsn);
            put_string(out, &m.name, "origin name")?;
        }
        Message::Relation(m) => {
            put_xid(out, m.xid);
            out.put_u32(m.oid);
            put_string(out, &m.namespace, "namespace")?;
            put_string(out, &m.name, "relation name")?;
            out.put_u8(m.replica_identity.as_byte());
            out.put_u16(count_u16(m.columns.len(), "relation column count")?);
            for c in &m.columns {
                out.put_u8(if c.is_key { COLUMN_IS_KEY } else { 0 });
                put_string(out, &c.name, "column name")?;
                out.put_u32(c.type_oid);
                out.put_i32(c.type_modifier);
            }
        }
        Message::Type(m) => {
            put_xid(out, m.xid);
            out.put_u32(m.oid);
            put_string(out, &m.namespace, "type namespace")?;
            put_string(out, &m.name, "type name")?;
        }
        Message::Insert(m) => {
            put_xid(out, m.xid);
            out.put_u32(m.relation_oid);
            out.put_u8(b'N');
            put_tuple(out, &m.new)?;
        }
        Message::Update(m) => {
            put_xid(out, m.xid);
            out.put_u32(m.relation_oid);
            if let Some(old) = &m.old {
                put_old_tuple(out, old)?;
            }
            out.put_u8(b'N');
            put_tuple(out, &m.new)?;
        }
        Message::Delete(m) => {
            put_xid(out, m.xid);
            out.put_u32(m.relation_oid);
            put_old_tuple(out, &m.old)?;
        }
        Message::Truncate(m) => {
            put_xid(out, m.xid);
            let count =
                u32::try_from(m.relation_oids.len()).map_err(|_| EncodeError::TooLarge {
                    what: "truncated relation count",
                    count: m.relation_oids.len() as u64,
                    max: u32::MAX.into(),
                })?;
            out.put_u32(count);
            let mut flags = 0;
            if m.cascade {
                flags |= TRUNCATE_CASCADE;
            }
            if m.restart_identity {
                flags |= TRUNCATE_RESTART_IDENTITY;
            }
            out.put_u8(flags);
            for &oid in &m.relation_oids {
                out.put_u32(oid);
            }
        }
        Message::Message(m) => {
            put_xid(out, m.xid);
            out.put_u8(u8::from(m.transactional));
            put_lsn(out, m.lsn);
            put_string(out, &m.prefix, "message prefix")?;
            put_len_prefixed(out, &m.content, "message content length")?;
        }
        Message::StreamStart(m) => {
            out.put_u32(m.xid);
            out.put_u8(u8::from(m.first_segment));
        }
        Message::StreamStop => {}
        Message::StreamCommit(m) => {
            out.put_u32(m.xid);
            out.put_u8(0);
            put_lsn(out, m.commit_lsn);
            put_lsn(out, m.end_lsn);
            put_ts(out, m.commit_timestamp);
        }
        Message::StreamAbort(m) => {
            if m.abort_info.is_some() != ctx.abort_info_expected() {
                return Err(EncodeError::AbortInfoMismatch { ctx: *ctx });
            }
            out.put_u32(m.xid);
            out.put_u32(m.subtransaction_xid);
            if let Some(info) = &m.abort_info {
                put_lsn(out, info.abort_lsn);
                put_ts(out, info.abort_timestamp);
            }
        }
        Message::BeginPrepare(m) => {
            put_lsn(out, m.prepare_lsn);
            put_lsn(out, m.end_lsn);
            put_ts(out, m.prepare_timestamp);
            out.put_u32(m.xid);
            put_string(out, &m.gid, "GID")?;
        }
        Message::Prepare(m) => {
            out.put_u8(0);
            put_lsn(out, m.prepare_lsn);
            put_lsn(out, m.end_lsn);
            put_ts(out, m.prepare_timestamp);
            out.put_u32(m.xid);
            put_string(out, &m.gid, "GID")?;
        }
        Message::CommitPrepared(m) => {
            out.put_u8(0);
            put_lsn(out, m.commit_lsn);
            put_lsn(out, m.end_lsn);
            put_ts(out, m.commit_timestamp);
            out.put_u32(m.xid);
            put_string(out, &m.gid, "GID")?;
        }
        Message::RollbackPrepared(m) => {
            out.put_u8(0);
            put_lsn(out, m.prepare_end_lsn);
            put_lsn(out, m.rollback_end_lsn);
            put_ts(out, m.prepare_timestamp);
            put_ts(out, m.rollback_timestamp);
            out.put_u32(m.xid);
            put_string(out, &m.gid, "GID")?;
        }
        Message::StreamPrepare(m) => {
            out.put_u8(0);
            put_lsn(out, m.prepare_lsn);
            put_lsn(out, m.end_lsn);
            put_ts(out, m.prepare_timestamp);
            out.put_u32(m.xid);
            put_string(out, &m.gid, "GID")?;
        }
    }
    Ok(())
}

/// `Some(xid field)` for the message types that carry the stream xid prefix.
fn data_message_xid(msg: &Message) -> Option<Option<u32>> {
    match msg {
        Message::Relation(m) => Some(m.xid),
        Message::Type(m) => Some(m.xid),
        Message::Insert(m) => Some(m.xid),
        Message::Update(m) => Some(m.xid),
        Message::Delete(m) => Some(m.xid),
        Message::Truncate(m) => Some(m.xid),
        Message::Message(m) => Some(m.xid),
        _ => None,
    }
}

fn put_xid(out: &mut BytesMut, xid: Option<u32>) {
    if let Some(xid) = xid {
        out.put_u32(xid);
    }
}

fn put_lsn(out: &mut BytesMut, lsn: Lsn) {
    out.put_u64(lsn.0);
}

fn put_ts(out: &mut BytesMut, ts: PgTimestamp) {
    out.put_i64(ts.0);
}

fn put_string(out: &mut BytesMut, s: &str, what: &'static str) -> Result<(), EncodeError> {
    if s.as_bytes().contains(&0) {
        return Err(EncodeError::NulInString { what });
    }
    out.put_slice(s.as_bytes());
    out.put_u8(0);
    Ok(())
}

fn put_len_prefixed(
    out: &mut BytesMut,
    value: &[u8],
    what: &'static str,
) -> Result<(), EncodeError> {
    let len = u32::try_from(value.len()).map_err(|_| EncodeError::TooLarge {
        what,
        count: value.len() as u64,
        max: u32::MAX.into(),
    })?;
    out.put_u32(len);
    out.put_slice(value);
    Ok(())
}

fn count_u16(n: usize, what: &'static str) -> Result<u16, EncodeError> {
    u16::try_from(n).map_err(|_| EncodeError::TooLarge {
        what,
        count: n as u64,
        max: u16::MAX.into(),
    })
}

fn put_old_tuple(out: &mut BytesMut, old: &OldTuple) -> Result<(), EncodeError> {
    match old {
        OldTuple::Key(k) => {
            out.put_u8(b'K');
            put_tuple(out, k.wire())
        }
        OldTuple::Full(t) => {
            out.put_u8(b'O');
            put_tuple(out, t)
        }
    }
}

fn put_tuple(out: &mut BytesMut, tuple: &TupleData) -> Result<(), EncodeError> {
    out.put_u16(count_u16(tuple.columns.len(), "tuple column count")?);
    for value in &tuple.columns {
        out.put_u8(value.marker());
        match value {
            ColumnValue::Null | ColumnValue::UnchangedToast => {}
            ColumnValue::Text(b) => put_len_prefixed(out, b, "text value length")?,
            ColumnValue::Binary(b) => put_len_prefixed(out, b, "binary value length")?,
        }
    }
    Ok(())
}
