//! A connection in CopyBoth mode after START_REPLICATION ... LOGICAL.

use postgres_protocol::message::frontend;

use super::codec;
use super::connection::{Connection, Session, put_copy_data};
use super::{ClientError, ReplicationClient};
use crate::walsender::{ServerMessage, StandbyStatusUpdate};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Streaming,
    /// The server sent CopyDone (it is shutting down or ended the stream).
    ServerDone,
    /// An error ended the stream; `next` yields nothing more.
    Failed,
}

/// The server's half of the stream is read only when `next` is called, so a
/// slow consumer slows the walsender down through TCP instead of buffering
/// without bound here.
///
/// Status updates are never sent implicitly: only the caller knows which
/// positions are durable. Answer a keepalive with `reply_requested` promptly,
/// or the walsender drops the connection after `wal_sender_timeout`.
pub struct LogicalReplicationStream {
    conn: Connection,
    session: Session,
    state: State,
}

impl LogicalReplicationStream {
    pub(crate) fn new(conn: Connection, session: Session) -> Self {
        LogicalReplicationStream {
            conn,
            session,
            state: State::Streaming,
        }
    }

    /// The next XLogData or keepalive. `None` once the server ended the
    /// stream (CopyDone) or after an error was returned.
    ///
    /// Cancel-safe: it may be raced against a timer in `select!`; a partially
    /// received message stays buffered for the next call.
    pub async fn next(&mut self) -> Option<Result<ServerMessage, ClientError>> {
        if self.state != State::Streaming {
            return None;
        }
        loop {
            let frame = match self.conn.read_frame().await {
                Ok(f) => f,
                Err(e) => return Some(Err(self.fail(e))),
            };
            match self.session.absorb(&frame, &self.conn.peer) {
                Ok(true) => continue,
                Ok(false) => {}
                Err(e) => return Some(Err(self.fail(e))),
            }
            return match frame.tag {
                b'd' => match ServerMessage::decode(frame.body) {
                    Ok(m) => Some(Ok(m)),
                    Err(e) => Some(Err(self.fail(e.into()))),
                },
                b'c' => {
                    self.state = State::ServerDone;
                    None
                }
                b'E' => Some(Err(self.fail(codec::server_error(&frame.body)))),
                tag => Some(Err(
                    self.fail(codec::unexpected(tag, "during logical replication"))
                )),
            };
        }
    }

    fn fail(&mut self, e: ClientError) -> ClientError {
        self.state = State::Failed;
        e
    }

    /// Sends a standby status update. For logical slots, `flush` becomes the
    /// slot's confirmed_flush_lsn: only report what is durable.
    ///
    /// If this future is dropped before completing, the unsent rest stays
    /// queued and goes out with the next send (the server sees one whole message).
    pub async fn send_status(&mut self, update: &StandbyStatusUpdate) -> Result<(), ClientError> {
        if self.state == State::Failed {
            return Err(ClientError::protocol(
                "cannot send a status update: the stream already failed",
            ));
        }
        put_copy_data(self.conn.wbuf(), 34, |b| update.encode(b));
        self.conn.flush().await
    }

    /// Ends streaming cleanly: sends CopyDone, discards data still in
    /// flight (it was not acknowledged, so the slot sends it again next time)
    /// and waits until the session is idle, returning the connection for
    /// more commands (e.g. DROP_REPLICATION_SLOT) — but not for another
    /// START_REPLICATION: PostgreSQL's walsender cannot stream logically
    /// twice on one connection, so the returned client refuses that.
    pub async fn finish(mut self) -> Result<ReplicationClient, ClientError> {
        if self.state == State::Failed {
            return Err(ClientError::protocol(
                "cannot finish a stream that already failed; reconnect",
            ));
        }
        frontend::copy_done(self.conn.wbuf());
        self.conn.flush().await?;
        let mut error = None;
        let mut copy_done = self.state == State::ServerDone;
        loop {
            let frame = self.conn.read_reply(&mut self.session).await?;
            match frame.tag {
                // The walsender may still emit data or a keepalive after
                // its own CopyDone (its loop sends before checking for the
                // end), so CopyData is tolerated until ReadyForQuery.
                b'd' => {}
                b'c' if !copy_done => copy_done = true,
                // After CopyDone: CommandComplete (and, for physical
                // replication only, a timeline result set we ignore).
                b'C' | b'T' | b'D' if copy_done => {}
                b'E' => {
                    error.get_or_insert(codec::server_error(&frame.body));
                }
                b'Z' => break,
                tag => return Err(codec::unexpected(tag, "while ending logical replication")),
            }
        }
        match error {
            Some(e) => Err(e),
            None => Ok(ReplicationClient::after_stream(self.conn, self.session)),
        }
    }

    /// Closes the connection without the CopyDone handshake (the server sees
    /// Terminate). Use when the stream is being abandoned anyway.
    pub async fn close(mut self) {
        if self.state == State::Streaming {
            frontend::copy_done(self.conn.wbuf());
        }
        self.conn.terminate().await;
    }

    /// Reads at least `bytes` at a time while set (0: as they arrive); see
    /// `Connection::set_read_batch`. For a stream far behind its publisher:
    /// a reader that drains the socket as fast as the walsender writes is
    /// woken, and the walsender pays for waking it, once per message.
    pub fn set_read_batch(&mut self, bytes: usize) {
        self.conn.set_read_batch(bytes);
    }

    /// A server parameter reported at startup or since (e.g. `server_version`).
    pub fn parameter(&self, name: &str) -> Option<&str> {
        self.session.params.get(name).map(String::as_str)
    }

    /// Whether the session runs over TLS.
    pub fn is_tls(&self) -> bool {
        self.conn.tls
    }

    /// The walsender's process id on the server.
    pub fn backend_pid(&self) -> Option<i32> {
        self.session.backend_pid
    }
}

impl std::fmt::Debug for LogicalReplicationStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogicalReplicationStream")
            .field("peer", &self.conn.peer)
            .field("tls", &self.conn.tls)
            .field("state", &self.state)
            .finish()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::Lsn;
    use bytes::BytesMut;
    use futures_util::FutureExt;
    use tokio::io::AsyncWriteExt;

    fn copy_data(msg: &ServerMessage) -> Vec<u8> {
        let mut payload = BytesMut::new();
        msg.encode(&mut payload);
        let mut frame = vec![b'd'];
        frame.extend_from_slice(&((payload.len() + 4) as u32).to_be_bytes());
        frame.extend_from_slice(&payload);
        frame
    }

    /// Feeds the stream one byte at a time and drops the pending `next()`
    /// after every byte: each message must still come out whole, once.
    #[tokio::test]
    async fn dropping_pending_next_loses_nothing() {
        let (client_io, mut server_io) = tokio::io::duplex(64);
        let conn = Connection::for_test(Box::new(client_io));
        let mut stream = LogicalReplicationStream::new(conn, Session::default());
        let sent = vec![
            ServerMessage::XLogData {
                wal_start: Lsn(1),
                wal_end: Lsn(2),
                send_time: 3,
                data: bytes::Bytes::from(vec![b'I'; 300]),
            },
            ServerMessage::PrimaryKeepalive {
                wal_end: Lsn(4),
                send_time: 5,
                reply_requested: true,
            },
        ];
        let wire: Vec<u8> = sent.iter().flat_map(copy_data).collect();
        let mut got = Vec::new();
        let mut cancelled = 0;
        for byte in wire {
            server_io.write_all(&[byte]).await.unwrap();
            match stream.next().now_or_never() {
                None => cancelled += 1,
                Some(m) => got.push(m.unwrap().unwrap()),
            }
        }
        assert_eq!(got, sent);
        assert!(cancelled > 300);

        // CopyDone ends the stream.
        server_io.write_all(&[b'c', 0, 0, 0, 4]).await.unwrap();
        assert!(stream.next().await.is_none());
        assert!(stream.next().await.is_none());
    }

    #[tokio::test]
    async fn server_error_ends_the_stream() {
        let (client_io, mut server_io) = tokio::io::duplex(1024);
        let conn = Connection::for_test(Box::new(client_io));
        let mut stream = LogicalReplicationStream::new(conn, Session::default());
        let body = b"SFATAL\0VFATAL\0C57P01\0Mterminating\0\0";
        let mut frame = vec![b'E'];
        frame.extend_from_slice(&((body.len() + 4) as u32).to_be_bytes());
        frame.extend_from_slice(body);
        server_io.write_all(&frame).await.unwrap();
        let err = stream.next().await.unwrap().unwrap_err();
        assert_eq!(err.code(), Some("57P01"));
        assert!(stream.next().await.is_none());
        assert!(
            stream
                .send_status(&StandbyStatusUpdate::all(Lsn(1)))
                .await
                .is_err()
        );
    }

    #[tokio::test]
    async fn status_update_goes_out_as_copy_data() {
        let (client_io, mut server_io) = tokio::io::duplex(1024);
        let conn = Connection::for_test(Box::new(client_io));
        let mut stream = LogicalReplicationStream::new(conn, Session::default());
        let update = StandbyStatusUpdate {
            write: Lsn(7),
            flush: Lsn(6),
            apply: Lsn(5),
            send_time: 4,
            reply_requested: true,
        };
        stream.send_status(&update).await.unwrap();
        let mut buf = [0u8; 39];
        tokio::io::AsyncReadExt::read_exact(&mut server_io, &mut buf)
            .await
            .unwrap();
        assert_eq!(buf[0], b'd');
        assert_eq!(u32::from_be_bytes(buf[1..5].try_into().unwrap()), 38);
        assert_eq!(StandbyStatusUpdate::decode(&buf[5..]).unwrap(), update);
    }
}
