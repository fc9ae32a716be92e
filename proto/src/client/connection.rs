//! The byte transport under a replication connection: socket setup (TCP or
//! Unix, optional TLS), buffered frame reads and queued writes.
//!
//! Cancel safety is the point of the buffer layout: bytes read from the
//! socket live in `rbuf` until a whole frame is taken out synchronously, and
//! bytes to send live in `wbuf` until the socket accepted them. Dropping a
//! pending `read_frame` or `flush` future therefore loses nothing; the next
//! call picks up where the previous one stopped.

use crate::client::sockopt;
use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

use bytes::{BufMut, BytesMut};
use postgres_protocol::message::frontend;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};

use super::codec::{self, Frame};
use super::config::{Host, ReplicationConfig, SslMode, Target};
use super::{ClientError, auth, tls};

/// Room to read into at a time: large enough that a burst of small
/// replication messages costs one syscall, small enough to stay in cache.
const READ_CHUNK: usize = 64 * 1024;

/// Below this much room left in the current chunk, a read starts a new one.
/// Frames taken out of a chunk share it (their bodies are `Bytes` views)
/// and keep all of it alive until the applier is done with them, which is
/// after their transaction committed here. Starting a new chunk for every
/// read pinned a whole `READ_CHUNK` per read: a consumer that keeps up
/// with the walsender reads a few messages at a time, and a backlog of
/// 1000-row transactions then held 150-270 MB where the messages were a
/// few MB (and the fresh pages' faults cost the agent CPU the walsender
/// needed on a 2-core machine).
const MIN_READ_ROOM: usize = 8 * 1024;

/// How long a batched read waits before it takes what is there: a
/// trickle (keepalives, a publisher decoding WAL it does not send) is
/// delayed by at most this, far below any lag worth batching for.
const BATCH_WAIT: Duration = Duration::from_millis(5);

/// The receive buffer of a socket read in batches (`SO_RCVBUF`, locked;
/// the kernel caps it at `net.core.rmem_max`, then doubles it).
///
/// A walsender writes and flushes every message, and each write that
/// leaves as a TCP segment of its own the walsender carries through the
/// whole loopback stack itself: its CPU follows the number of segments,
/// not the bytes. Read message by message as they arrived, every message
/// left alone. Measured on 100k single-row INSERT transactions in a
/// backlog (~20 MB), with the stream's 1 MiB read mark: at 64 KiB here
/// (128 KiB granted) the walsender sent 76k segments of 261 bytes on
/// average, at 1 MiB (2 MiB granted) 15k of 1.1 KB; its CPU for
/// single-row INSERT, UPDATE and DELETE backlogs went from 0.59-1.21 s
/// (above 0.85 in most runs) to 0.60-0.83 s (34 runs of 35). With
/// `net.core.rmem_max` at its default (212992, so 416 KiB granted) runs
/// went either way, as with 256 KiB asked for (512 granted): operators
/// set it to at least 1 MiB (README, "Node prerequisites").
const BATCH_RCVBUF: usize = 1024 * 1024;

/// The receive low-water mark (`SO_RCVLOWAT`) of a TCP connection's socket.
struct ReadBatch {
    /// The socket under `io`: owned by it, open as long as the connection.
    fd: RawFd,
    /// Bytes a read asks for; 0: batching off.
    want: usize,
    /// The mark is set above 1 on the socket now.
    raised: bool,
    /// The receive buffer was set to `BATCH_RCVBUF` (once, when batching
    /// first turned on; it stays so, as live reads need no more).
    buffer_set: bool,
}

impl ReadBatch {
    /// A failure turns batching off for good: reads then go byte-wise, as
    /// without it.
    fn set(&mut self, peer: &str, bytes: usize) {
        if bytes > 1 && !self.buffer_set {
            self.buffer_set = true;
            if let Err(e) = sockopt::set_rcvbuf(self.fd, BATCH_RCVBUF) {
                tracing::debug!(peer, error = %e, "cannot set SO_RCVBUF; the kernel sizes it");
            }
        }
        match sockopt::set_rcvlowat(self.fd, bytes.max(1)) {
            Ok(()) => self.raised = bytes > 1,
            Err(e) => {
                tracing::debug!(peer, error = %e, "cannot set SO_RCVLOWAT; reads are not batched");
                self.want = 0;
                self.raised = false;
            }
        }
    }
}

pub(crate) trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

pub(crate) struct Connection {
    io: Box<dyn Io>,
    rbuf: BytesMut,
    wbuf: BytesMut,
    /// Batched reads on a TCP socket (`set_read_batch`); `None` on a Unix
    /// socket, where the kernel has no receive low-water mark for poll.
    batch: Option<ReadBatch>,
    /// "host:port" or the socket path, for error messages.
    pub peer: String,
    pub tls: bool,
}

/// What the server told us during startup and since.
#[derive(Debug, Clone, Default)]
pub(crate) struct Session {
    pub params: HashMap<String, String>,
    pub backend_pid: Option<i32>,
}

impl Session {
    /// Absorbs asynchronous messages that may arrive at any time. Returns
    /// false for anything else, which the caller must handle.
    pub fn absorb(&mut self, frame: &Frame, peer: &str) -> Result<bool, ClientError> {
        match frame.tag {
            b'S' => {
                let mut b = codec::Body::new("ParameterStatus", &frame.body);
                let name = b.cstr()?;
                let value = b.cstr()?;
                self.params.insert(name, value);
                Ok(true)
            }
            b'N' => {
                let f = codec::parse_fields(&frame.body)?;
                tracing::info!(
                    peer,
                    severity = %f.severity,
                    code = %f.code,
                    "server notice: {}",
                    f.message
                );
                Ok(true)
            }
            // LISTEN is never issued on these connections, but a stray
            // notification must not break the protocol state machine.
            b'A' => Ok(true),
            _ => Ok(false),
        }
    }
}

impl Connection {
    fn new(io: Box<dyn Io>, peer: String, tls: bool) -> Connection {
        Connection {
            io,
            rbuf: BytesMut::with_capacity(READ_CHUNK),
            wbuf: BytesMut::with_capacity(1024),
            batch: None,
            peer,
            tls,
        }
    }

    fn tcp(io: Box<dyn Io>, fd: RawFd, peer: String, tls: bool) -> Connection {
        let mut conn = Connection::new(io, peer, tls);
        conn.batch = Some(ReadBatch {
            fd,
            want: 0,
            raised: false,
            buffer_set: false,
        });
        conn
    }

    /// Asks for reads of at least `bytes` at a time (0: every byte as it
    /// arrives). While the mark is up, the kernel neither wakes this process
    /// nor makes the sender pay for a wakeup until that much is buffered
    /// or the receive window is closed (Linux wakes a reader whose window
    /// is down to one segment, whatever its mark; see `BATCH_RCVBUF`). A
    /// read still
    /// returns within `BATCH_WAIT` with whatever arrived, so a trickle is
    /// only delayed, never stuck. Does nothing on a Unix socket.
    pub fn set_read_batch(&mut self, bytes: usize) {
        if let Some(b) = self.batch.as_mut() {
            b.want = bytes;
            if bytes == 0 && b.raised {
                b.set(&self.peer, 0);
            }
        }
    }

    #[cfg(test)]
    pub(crate) fn for_test(io: Box<dyn Io>) -> Connection {
        Connection::new(io, "test".to_owned(), false)
    }

    /// Reads the next complete backend message. Cancel-safe.
    pub async fn read_frame(&mut self) -> Result<Frame, ClientError> {
        loop {
            match codec::take_frame(&mut self.rbuf)? {
                Ok(frame) => return Ok(frame),
                Err(need) => {
                    let room = self.rbuf.capacity() - self.rbuf.len();
                    if room < need.max(MIN_READ_ROOM) {
                        self.rbuf.reserve(need.max(READ_CHUNK));
                    }
                    let n = self
                        .read_some()
                        .await
                        .map_err(|e| ClientError::io(format!("reading from {}", self.peer), e))?;
                    if n == 0 {
                        return Err(ClientError::io(
                            format!("reading from {}", self.peer),
                            io::Error::new(
                                io::ErrorKind::UnexpectedEof,
                                "server closed the connection",
                            ),
                        ));
                    }
                }
            }
        }
    }

    /// One read into `rbuf`. With batched reads asked for, the low-water mark
    /// goes up before the read and down again when `BATCH_WAIT` passes
    /// first (lowering it wakes the reader at once if anything is buffered).
    /// Cancel-safe: bytes move into `rbuf` only in a completed read.
    async fn read_some(&mut self) -> io::Result<usize> {
        let Connection {
            io,
            rbuf,
            batch,
            peer,
            ..
        } = self;
        if let Some(b) = batch.as_mut().filter(|b| b.want > 0) {
            if !b.raised {
                b.set(peer, b.want);
            }
            if b.raised {
                if let Ok(r) = tokio::time::timeout(BATCH_WAIT, io.read_buf(rbuf)).await {
                    return r;
                }
                b.set(peer, 0);
            }
        }
        io.read_buf(rbuf).await
    }

    /// The next frame that is not an asynchronous message (those are
    /// absorbed into `session`). Cancel-safe, as `read_frame`.
    pub async fn read_reply(&mut self, session: &mut Session) -> Result<Frame, ClientError> {
        loop {
            let frame = self.read_frame().await?;
            if !session.absorb(&frame, &self.peer)? {
                return Ok(frame);
            }
        }
    }

    /// The send buffer; messages appended here go out on the next `flush`.
    pub fn wbuf(&mut self) -> &mut BytesMut {
        &mut self.wbuf
    }

    /// Queues a simple-protocol Query.
    pub fn queue_query(&mut self, sql: &str) -> Result<(), ClientError> {
        frontend::query(sql, &mut self.wbuf)
            .map_err(|_| ClientError::protocol("cannot send a query containing a NUL byte"))
    }

    /// Writes everything queued. Cancel-safe: bytes leave `wbuf` only once
    /// the socket took them.
    pub async fn flush(&mut self) -> Result<(), ClientError> {
        while !self.wbuf.is_empty() {
            let n = self
                .io
                .write_buf(&mut self.wbuf)
                .await
                .map_err(|e| ClientError::io(format!("writing to {}", self.peer), e))?;
            if n == 0 {
                return Err(ClientError::io(
                    format!("writing to {}", self.peer),
                    io::ErrorKind::WriteZero.into(),
                ));
            }
        }
        self.io
            .flush()
            .await
            .map_err(|e| ClientError::io(format!("flushing to {}", self.peer), e))
    }

    /// Sends Terminate and closes the socket, ignoring errors: the server may
    /// already be gone, and there is nothing left to lose.
    pub async fn terminate(mut self) {
        frontend::terminate(&mut self.wbuf);
        let _ = self.flush().await;
        let _ = self.io.shutdown().await;
    }
}

/// Opens one connection to `target`, up to ReadyForQuery.
pub(crate) async fn connect_target(
    config: &ReplicationConfig,
    target: &Target,
    user: &str,
    replication: bool,
) -> Result<(Connection, Session), ClientError> {
    let mut conn = match &target.host {
        Host::Unix(dir) => {
            // As in libpq, sslmode does not apply to Unix sockets: the
            // kernel already keeps local traffic private.
            let path = dir.join(format!(".s.PGSQL.{}", target.port));
            let stream = UnixStream::connect(&path)
                .await
                .map_err(|e| ClientError::io(format!("connecting to {}", path.display()), e))?;
            Connection::new(Box::new(stream), path.display().to_string(), false)
        }
        Host::Tcp(host) => {
            let peer = format!("{host}:{}", target.port);
            let mut stream = match target.hostaddr {
                Some(addr) => TcpStream::connect(SocketAddr::new(addr, target.port)).await,
                None => TcpStream::connect((host.as_str(), target.port)).await,
            }
            .map_err(|e| ClientError::io(format!("connecting to {peer}"), e))?;
            // Status updates are tiny and latency-sensitive.
            stream
                .set_nodelay(true)
                .map_err(|e| ClientError::io(format!("setting TCP_NODELAY on {peer}"), e))?;
            let fd = stream.as_raw_fd();
            if config.ssl_mode == SslMode::Disable {
                Connection::tcp(Box::new(stream), fd, peer, false)
            } else if negotiate_tls(&mut stream, &peer).await? {
                let tls_config = tls::client_config(config)?;
                let name = tls::server_name(host)?;
                let tls_stream = tokio_rustls::TlsConnector::from(tls_config)
                    .connect(name, stream)
                    .await
                    .map_err(|e| ClientError::Tls(format!("handshake with {peer}: {e}")))?;
                Connection::tcp(Box::new(tls_stream), fd, peer, true)
            } else if config.ssl_mode.requires_tls() {
                return Err(ClientError::Tls(format!(
                    "{peer} does not support TLS, but sslmode={:?} requires it",
                    config.ssl_mode
                )));
            } else {
                Connection::tcp(Box::new(stream), fd, peer, false)
            }
        }
    };

    let mut params: Vec<(&str, &str)> = vec![("user", user)];
    if replication {
        params.push(("replication", "database"));
    }
    if let Some(db) = config.dbname() {
        params.push(("database", db));
    }
    if let Some(app) = config.application_name() {
        params.push(("application_name", app));
    }
    if let Some(options) = config.options.as_deref() {
        params.push(("options", options));
    }
    // We decode every server string as UTF-8, so ask for it unless the
    // caller chose otherwise.
    if !config.params.iter().any(|(k, _)| k == "client_encoding") {
        params.push(("client_encoding", "UTF8"));
    }
    params.extend(config.params.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    frontend::startup_message(params, conn.wbuf())
        .map_err(|_| ClientError::Config("a startup parameter contains a NUL byte".into()))?;
    conn.flush().await?;

    auth::authenticate(&mut conn, user, config.password.as_deref()).await?;

    let mut session = Session::default();
    loop {
        let frame = conn.read_reply(&mut session).await?;
        match frame.tag {
            b'K' => {
                let mut b = codec::Body::new("BackendKeyData", &frame.body);
                session.backend_pid = Some(b.i32()?);
            }
            b'Z' => return Ok((conn, session)),
            b'E' => return Err(codec::server_error(&frame.body)),
            // Only sent when we ask for protocol extensions, which we don't;
            // harmless if a proxy sends it anyway.
            b'v' => {}
            tag => {
                return Err(codec::unexpected(
                    tag,
                    "while waiting for ReadyForQuery after authentication",
                ));
            }
        }
    }
}

/// Sends SSLRequest and reads the one-byte answer. Reads exactly one byte,
/// unbuffered: anything the server sends before the handshake must not be
/// mistaken for encrypted-session data (CVE-2021-23222).
async fn negotiate_tls(stream: &mut TcpStream, peer: &str) -> Result<bool, ClientError> {
    let mut buf = BytesMut::with_capacity(8);
    frontend::ssl_request(&mut buf);
    stream
        .write_all(&buf)
        .await
        .map_err(|e| ClientError::io(format!("sending SSLRequest to {peer}"), e))?;
    let answer = stream
        .read_u8()
        .await
        .map_err(|e| ClientError::io(format!("reading SSLRequest answer from {peer}"), e))?;
    match answer {
        b'S' => Ok(true),
        b'N' => Ok(false),
        other => Err(ClientError::protocol(format!(
            "unexpected answer {:?} to SSLRequest from {peer}",
            char::from(other)
        ))),
    }
}

/// Appends a CopyData message carrying `payload_len` bytes written by `fill`.
pub(crate) fn put_copy_data(
    buf: &mut BytesMut,
    payload_len: usize,
    fill: impl FnOnce(&mut BytesMut),
) {
    buf.reserve(5 + payload_len);
    buf.put_u8(b'd');
    // Callers only send fixed-size status updates, far below i32::MAX.
    buf.put_i32((4 + payload_len) as i32);
    let before = buf.len();
    fill(buf);
    debug_assert_eq!(buf.len() - before, payload_len);
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use tokio::io::AsyncWriteExt;

    use super::*;

    /// A reader that keeps up with the server takes one small message per
    /// read. Frames kept alive (as the applier keeps a transaction's
    /// messages until it committed) must share chunks, not pin one chunk
    /// per read: 200 messages of 100 bytes fit in one.
    #[tokio::test]
    async fn small_reads_share_a_chunk() {
        let (client_io, mut server_io) = tokio::io::duplex(READ_CHUNK);
        let mut conn = Connection::for_test(Box::new(client_io));
        let mut kept = Vec::new();
        for i in 0..200u8 {
            let mut frame = vec![b'd', 0, 0, 0, 104];
            frame.extend_from_slice(&[i; 100]);
            server_io.write_all(&frame).await.unwrap();
            let f = conn.read_frame().await.unwrap();
            assert_eq!((f.tag, f.body.len(), f.body[0]), (b'd', 100, i));
            kept.push(f);
        }
        let at: Vec<usize> = kept.iter().map(|f| f.body.as_ptr() as usize).collect();
        let spread = at.iter().max().unwrap() - at.iter().min().unwrap();
        assert!(
            spread < READ_CHUNK,
            "200 small frames spread over {spread} bytes of chunks"
        );
    }

    fn frame_of(i: u8, len: usize) -> Vec<u8> {
        let mut frame = vec![b'd'];
        frame.extend_from_slice(&u32::try_from(len + 4).unwrap().to_be_bytes());
        frame.extend_from_slice(&vec![i; len]);
        frame
    }

    /// With batched reads asked for on a real TCP socket (1 MiB, as the
    /// stream asks), the receive buffer is locked at `BATCH_RCVBUF` (as
    /// far as `net.core.rmem_max` allows), a message smaller than the mark
    /// still arrives (within `BATCH_WAIT`, not never), a burst many times
    /// the buffer arrives whole and in order, and turning batching off
    /// goes back to plain reads.
    #[tokio::test]
    async fn batched_reads_never_hold_back_a_small_message() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let client = TcpStream::connect(addr).await.unwrap();
        let (mut server, _) = listener.accept().await.unwrap();
        let fd = client.as_raw_fd();
        let mut conn = Connection::tcp(Box::new(client), fd, "test".into(), false);
        let before = super::sockopt::rcvbuf(fd).unwrap();
        conn.set_read_batch(1 << 20);
        let patience = Duration::from_secs(5);

        for i in 0..3u8 {
            server.write_all(&frame_of(i, 10)).await.unwrap();
            let f = tokio::time::timeout(patience, conn.read_frame())
                .await
                .expect("a message below the low-water mark was held back")
                .unwrap();
            assert_eq!((f.tag, f.body.len(), f.body[0]), (b'd', 10, i));
        }
        assert!(conn.batch.as_ref().is_some_and(|b| b.want > 0));
        let locked = super::sockopt::rcvbuf(fd).unwrap();
        // The kernel caps SO_RCVBUF at net.core.rmem_max, then doubles it.
        let rmem_max: usize = std::fs::read_to_string("/proc/sys/net/core/rmem_max")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert_eq!(
            locked,
            2 * BATCH_RCVBUF.min(rmem_max),
            "buffer {before} -> {locked}"
        );

        let frames = 3 * locked / 1000;
        let writer = tokio::spawn(async move {
            let burst: Vec<u8> = (0..frames).flat_map(|i| frame_of(i as u8, 1000)).collect();
            server.write_all(&burst).await.unwrap();
            server
        });
        for i in 0..frames {
            let f = tokio::time::timeout(patience, conn.read_frame())
                .await
                .expect("a burst larger than the buffer was held back")
                .unwrap();
            let b = i as u8;
            assert_eq!((f.body.len(), f.body[0], f.body[999]), (1000, b, b));
        }
        let mut server = writer.await.unwrap();

        conn.set_read_batch(0);
        assert!(conn.batch.as_ref().is_some_and(|b| !b.raised));
        server.write_all(&frame_of(7, 1)).await.unwrap();
        let f = tokio::time::timeout(patience, conn.read_frame())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(f.body[..], [7]);
    }
}
