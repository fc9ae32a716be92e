//! The walsender's CopyBoth sub-protocol: what travels inside CopyData
//! messages once START_REPLICATION has switched the connection to streaming.
//!
//! Server to client: XLogData ('w') carrying one output-plugin message, and
//! primary keepalives ('k'). Client to server: standby status updates ('r').
//! All integers are big-endian; times are microseconds since 2000-01-01 UTC
//! (PostgreSQL's epoch), not Unix time.
//!
//! Sans-I/O on purpose: these functions only look at bytes, so malformed input
//! from a peer is a typed error here, never a panic, and can be fuzzed alone.

use std::time::{SystemTime, UNIX_EPOCH};

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::Lsn;

/// Seconds from the Unix epoch to PostgreSQL's epoch (2000-01-01 00:00:00 UTC).
const PG_EPOCH_UNIX_SECS: i64 = 946_684_800;

/// Header sizes including the one-byte tag, from PostgreSQL's protocol docs.
const XLOG_DATA_HEADER_LEN: usize = 1 + 8 + 8 + 8;
const KEEPALIVE_LEN: usize = 1 + 8 + 8 + 1;
const STATUS_UPDATE_LEN: usize = 1 + 8 + 8 + 8 + 8 + 1;

/// Now, as a PostgreSQL timestamp: microseconds since 2000-01-01 UTC.
///
/// The walsender uses the status update's send_time only for lag statistics
/// (`pg_stat_replication.*_lag`) and replies, so a clock before 2000 just
/// yields a negative number rather than an error.
pub fn pg_now_micros() -> i64 {
    let unix_micros = match SystemTime::now().duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_micros()).unwrap_or(i64::MAX),
        Err(e) => i64::try_from(e.duration().as_micros()).map_or(i64::MIN, |m| -m),
    };
    unix_micros.saturating_sub(PG_EPOCH_UNIX_SECS * 1_000_000)
}

/// Converts a PostgreSQL timestamp (µs since 2000-01-01 UTC) to a chrono
/// UTC time, for lag reporting. `None` when out of chrono's range.
pub fn pg_micros_to_datetime(micros: i64) -> Option<chrono::DateTime<chrono::Utc>> {
    let unix_micros = micros.checked_add(PG_EPOCH_UNIX_SECS * 1_000_000)?;
    chrono::DateTime::from_timestamp_micros(unix_micros)
}

/// Why a CopyData payload could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WalSenderError {
    #[error("empty CopyData payload from walsender")]
    Empty,
    #[error("unknown walsender message tag {tag:#04x} ({:?})", char::from(*tag))]
    UnknownTag { tag: u8 },
    #[error("truncated walsender {kind} message: {len} bytes, need {need}")]
    Truncated {
        kind: &'static str,
        len: usize,
        need: usize,
    },
    #[error("walsender {kind} message has {extra} trailing bytes")]
    TrailingBytes { kind: &'static str, extra: usize },
}

/// A message from the walsender inside CopyData.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerMessage {
    /// One chunk of output-plugin data (for pgoutput: exactly one logical
    /// replication message). `data` shares the receive buffer: no copy.
    XLogData {
        /// WAL position the data starts at (for pgoutput: the position of the
        /// record that produced it; 0/0 for some messages).
        wal_start: Lsn,
        /// The server's current end of WAL.
        wal_end: Lsn,
        send_time: i64,
        data: Bytes,
    },
    /// Sent when idle and when the server wants a status update soon
    /// (`reply_requested`: reply now or the walsender times us out).
    PrimaryKeepalive {
        wal_end: Lsn,
        send_time: i64,
        reply_requested: bool,
    },
}

impl ServerMessage {
    /// Decodes one CopyData payload. Takes `Bytes` so XLogData's `data` can be
    /// a zero-copy slice of it.
    pub fn decode(mut payload: Bytes) -> Result<ServerMessage, WalSenderError> {
        let tag = *payload.first().ok_or(WalSenderError::Empty)?;
        match tag {
            b'w' => {
                need("XLogData", &payload, XLOG_DATA_HEADER_LEN)?;
                payload.advance(1);
                let wal_start = Lsn(payload.get_u64());
                let wal_end = Lsn(payload.get_u64());
                let send_time = payload.get_i64();
                Ok(ServerMessage::XLogData {
                    wal_start,
                    wal_end,
                    send_time,
                    data: payload,
                })
            }
            b'k' => {
                exact("keepalive", &payload, KEEPALIVE_LEN)?;
                payload.advance(1);
                let wal_end = Lsn(payload.get_u64());
                let send_time = payload.get_i64();
                let reply_requested = payload.get_u8() != 0;
                Ok(ServerMessage::PrimaryKeepalive {
                    wal_end,
                    send_time,
                    reply_requested,
                })
            }
            tag => Err(WalSenderError::UnknownTag { tag }),
        }
    }

    /// Encodes as the server would; for tests and test servers.
    pub fn encode(&self, out: &mut BytesMut) {
        match self {
            ServerMessage::XLogData {
                wal_start,
                wal_end,
                send_time,
                data,
            } => {
                out.reserve(XLOG_DATA_HEADER_LEN + data.len());
                out.put_u8(b'w');
                out.put_u64(wal_start.0);
                out.put_u64(wal_end.0);
                out.put_i64(*send_time);
                out.put_slice(data);
            }
            ServerMessage::PrimaryKeepalive {
                wal_end,
                send_time,
                reply_requested,
            } => {
                out.reserve(KEEPALIVE_LEN);
                out.put_u8(b'k');
                out.put_u64(wal_end.0);
                out.put_i64(*send_time);
                out.put_u8(u8::from(*reply_requested));
            }
        }
    }

    /// The server's end of WAL carried by either message: the "received up
    /// to" position a client may report when it has nothing pending.
    pub fn wal_end(&self) -> Lsn {
        match self {
            ServerMessage::XLogData { wal_end, .. }
            | ServerMessage::PrimaryKeepalive { wal_end, .. } => *wal_end,
        }
    }
}

/// The client's progress report ('r').
///
/// For logical replication the walsender uses `flush` as the slot's
/// confirmed_flush_lsn: reporting a position promises the changes below it
/// are durable on the subscriber and need never be sent again. `write` and
/// `apply` only feed `pg_stat_replication`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StandbyStatusUpdate {
    pub write: Lsn,
    pub flush: Lsn,
    pub apply: Lsn,
    /// µs since 2000-01-01 UTC, see [`pg_now_micros`].
    pub send_time: i64,
    /// Asks the server to answer with a keepalive right away.
    pub reply_requested: bool,
}

impl StandbyStatusUpdate {
    /// A status update reporting `lsn` for write, flush and apply, stamped now.
    pub fn all(lsn: Lsn) -> StandbyStatusUpdate {
        StandbyStatusUpdate {
            write: lsn,
            flush: lsn,
            apply: lsn,
            send_time: pg_now_micros(),
            reply_requested: false,
        }
    }

    /// Appends the CopyData payload (not the CopyData framing) to `out`.
    pub fn encode(&self, out: &mut BytesMut) {
        out.reserve(STATUS_UPDATE_LEN);
        out.put_u8(b'r');
        out.put_u64(self.write.0);
        out.put_u64(self.flush.0);
        out.put_u64(self.apply.0);
        out.put_i64(self.send_time);
        out.put_u8(u8::from(self.reply_requested));
    }

    /// The payload as a standalone buffer.
    pub fn to_bytes(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(STATUS_UPDATE_LEN);
        self.encode(&mut out);
        out.freeze()
    }

    /// Decodes a status update payload (what a walsender would parse).
    pub fn decode(payload: &[u8]) -> Result<StandbyStatusUpdate, WalSenderError> {
        let tag = *payload.first().ok_or(WalSenderError::Empty)?;
        if tag != b'r' {
            return Err(WalSenderError::UnknownTag { tag });
        }
        exact("standby status update", payload, STATUS_UPDATE_LEN)?;
        let mut p = &payload[1..];
        Ok(StandbyStatusUpdate {
            write: Lsn(p.get_u64()),
            flush: Lsn(p.get_u64()),
            apply: Lsn(p.get_u64()),
            send_time: p.get_i64(),
            reply_requested: p.get_u8() != 0,
        })
    }
}

fn need(kind: &'static str, payload: &[u8], need: usize) -> Result<(), WalSenderError> {
    if payload.len() < need {
        return Err(WalSenderError::Truncated {
            kind,
            len: payload.len(),
            need,
        });
    }
    Ok(())
}

/// Fixed-size messages must be exactly their size: trailing bytes mean we and
/// the server disagree about the protocol, which must not pass silently.
fn exact(kind: &'static str, payload: &[u8], len: usize) -> Result<(), WalSenderError> {
    need(kind, payload, len)?;
    if payload.len() > len {
        return Err(WalSenderError::TrailingBytes {
            kind,
            extra: payload.len() - len,
        });
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn decodes_xlogdata_by_hand() {
        let mut raw = vec![b'w'];
        raw.extend_from_slice(&0x16_B374_D848u64.to_be_bytes());
        raw.extend_from_slice(&0x17_0000_0000u64.to_be_bytes());
        raw.extend_from_slice(&123_456i64.to_be_bytes());
        raw.extend_from_slice(b"Bpayload");
        let msg = ServerMessage::decode(Bytes::from(raw)).unwrap();
        assert_eq!(
            msg,
            ServerMessage::XLogData {
                wal_start: Lsn(0x16_B374_D848),
                wal_end: Lsn(0x17_0000_0000),
                send_time: 123_456,
                data: Bytes::from_static(b"Bpayload"),
            }
        );
        assert_eq!(msg.wal_end(), Lsn(0x17_0000_0000));
    }

    #[test]
    fn decodes_empty_xlogdata_body() {
        let mut raw = vec![b'w'];
        raw.extend_from_slice(&[0; 24]);
        match ServerMessage::decode(Bytes::from(raw)).unwrap() {
            ServerMessage::XLogData { data, .. } => assert!(data.is_empty()),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn decodes_keepalive_by_hand() {
        let mut raw = vec![b'k'];
        raw.extend_from_slice(&5u64.to_be_bytes());
        raw.extend_from_slice(&(-7i64).to_be_bytes());
        raw.push(1);
        assert_eq!(
            ServerMessage::decode(Bytes::from(raw)).unwrap(),
            ServerMessage::PrimaryKeepalive {
                wal_end: Lsn(5),
                send_time: -7,
                reply_requested: true
            }
        );
    }

    #[test]
    fn status_update_layout() {
        let u = StandbyStatusUpdate {
            write: Lsn(1),
            flush: Lsn(2),
            apply: Lsn(3),
            send_time: 4,
            reply_requested: true,
        };
        let b = u.to_bytes();
        assert_eq!(b.len(), 34);
        assert_eq!(b[0], b'r');
        assert_eq!(&b[1..9], &1u64.to_be_bytes());
        assert_eq!(&b[9..17], &2u64.to_be_bytes());
        assert_eq!(&b[17..25], &3u64.to_be_bytes());
        assert_eq!(&b[25..33], &4i64.to_be_bytes());
        assert_eq!(b[33], 1);
        assert_eq!(StandbyStatusUpdate::decode(&b).unwrap(), u);
    }

    #[test]
    fn short_and_bad_input_is_an_error() {
        assert_eq!(
            ServerMessage::decode(Bytes::new()),
            Err(WalSenderError::Empty)
        );
        assert_eq!(
            ServerMessage::decode(Bytes::from_static(b"x123")),
            Err(WalSenderError::UnknownTag { tag: b'x' })
        );
        for len in 1..XLOG_DATA_HEADER_LEN {
            let mut raw = vec![0u8; len];
            raw[0] = b'w';
            assert!(matches!(
                ServerMessage::decode(Bytes::from(raw)),
                Err(WalSenderError::Truncated { .. })
            ));
        }
        for len in 1..KEEPALIVE_LEN {
            let mut raw = vec![0u8; len];
            raw[0] = b'k';
            assert!(matches!(
                ServerMessage::decode(Bytes::from(raw)),
                Err(WalSenderError::Truncated { .. })
            ));
        }
        let mut raw = vec![0u8; KEEPALIVE_LEN + 1];
        raw[0] = b'k';
        assert_eq!(
            ServerMessage::decode(Bytes::from(raw)),
            Err(WalSenderError::TrailingBytes {
                kind: "keepalive",
                extra: 1
            })
        );
        assert!(StandbyStatusUpdate::decode(b"r").is_err());
        assert!(StandbyStatusUpdate::decode(b"").is_err());
        assert!(StandbyStatusUpdate::decode(&[b'k'; 34]).is_err());
    }

    #[test]
    fn now_is_after_2020_in_pg_epoch() {
        // 2020-01-01 is 631152000 s after 2000-01-01.
        let now = pg_now_micros();
        assert!(now > 631_152_000 * 1_000_000, "{now}");
        let dt = pg_micros_to_datetime(now).unwrap();
        let diff = (chrono::Utc::now() - dt).num_seconds().abs();
        assert!(diff < 5, "{diff}");
        assert_eq!(
            pg_micros_to_datetime(0).unwrap().to_rfc3339(),
            "2000-01-01T00:00:00+00:00"
        );
    }

    fn arb_server_message() -> impl Strategy<Value = ServerMessage> {
        prop_oneof![
            (
                any::<u64>(),
                any::<u64>(),
                any::<i64>(),
                proptest::collection::vec(any::<u8>(), 0..256)
            )
                .prop_map(|(s, e, t, d)| ServerMessage::XLogData {
                    wal_start: Lsn(s),
                    wal_end: Lsn(e),
                    send_time: t,
                    data: Bytes::from(d),
                }),
            (any::<u64>(), any::<i64>(), any::<bool>()).prop_map(|(e, t, r)| {
                ServerMessage::PrimaryKeepalive {
                    wal_end: Lsn(e),
                    send_time: t,
                    reply_requested: r,
                }
            }),
        ]
    }

    proptest! {
        #[test]
        fn server_message_round_trips(msg in arb_server_message()) {
            let mut buf = BytesMut::new();
            msg.encode(&mut buf);
            prop_assert_eq!(ServerMessage::decode(buf.freeze()).unwrap(), msg);
        }

        #[test]
        fn status_update_round_trips(w: u64, f: u64, a: u64, t: i64, r: bool) {
            let u = StandbyStatusUpdate {
                write: Lsn(w), flush: Lsn(f), apply: Lsn(a), send_time: t, reply_requested: r,
            };
            prop_assert_eq!(StandbyStatusUpdate::decode(&u.to_bytes()).unwrap(), u);
        }

        #[test]
        fn arbitrary_bytes_never_panic(raw in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = ServerMessage::decode(Bytes::from(raw.clone()));
            let _ = StandbyStatusUpdate::decode(&raw);
        }
    }
}
