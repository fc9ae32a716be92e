//! An ordinary (non-replication) session that pipelines extended-protocol
//! statements under one Sync per batch, for the agent's apply path.
//!
//! tokio-postgres ends every statement with Sync, so the server answers
//! each with ReadyForQuery and flushes its socket per statement; with
//! single-row transactions that flush, and the agent's read of it, cost
//! about as much as the statement. Here statements go out as Bind/Execute
//! with no Sync between them, and a Sync is sent only when the caller
//! waits for replies: the server then sends the replies of a whole batch
//! in a few large writes.
//!
//! What one Sync per batch changes, and the caller must rely on:
//! - Statements between two Syncs outside an explicit transaction block
//!   form ONE implicit transaction. Callers send BEGIN/COMMIT themselves.
//! - After an error the server skips every message up to the next Sync:
//!   those statements are reported as [`Reply::Skipped`], never run. The
//!   session stays in the failed transaction block until ROLLBACK
//!   ([`PipelinedSession::status`] says so).
//!
//! The reply bookkeeping ([`ReplyTracker`]) is sans-I/O: frames in,
//! replies out, tested without a server.

use std::collections::VecDeque;

use bytes::BytesMut;
use postgres_protocol::message::frontend;

use super::ClientError;
use super::codec::{self, ServerFields};
use super::config::ReplicationConfig;
use super::connection::{Connection, Session};

/// A server error, with the fields the apply path decides on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DbError {
    pub severity: String,
    pub code: String,
    pub message: String,
    pub detail: Option<String>,
    pub constraint: Option<String>,
}

impl From<ServerFields> for DbError {
    fn from(f: ServerFields) -> Self {
        DbError {
            severity: f.severity,
            code: f.code,
            message: f.message,
            detail: f.detail,
            constraint: f.constraint,
        }
    }
}

impl std::fmt::Display for DbError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {} (SQLSTATE {})",
            self.severity, self.message, self.code
        )?;
        if let Some(d) = &self.detail {
            write!(f, " DETAIL: {d}")?;
        }
        Ok(())
    }
}

/// The outcome of one executed statement, in the order they were sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// It ran: the row count of its command tag, and the sum of its rows'
    /// first column where that is an integer (a statement that counts
    /// something for the caller returns it there).
    Done { rows: u64, first_sum: i64 },
    /// It failed (or the statement it names failed to parse).
    Failed(DbError),
    /// Never run: an earlier statement of the same batch failed.
    Skipped,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Parse,
    Exec,
    Sync,
}

/// Which replies are owed, and what the frames read so far mean.
///
/// Asked after every frame read whether replies are owed and whether a
/// Sync must go first, with thousands of statements in flight: so the
/// answers are kept as counts (`execs`, `execs_before_sync`) as the
/// queue changes (`push`, `pop`), not found by walking it. Walking it
/// took a third of the agent's CPU on single-row transactions.
#[derive(Debug)]
pub struct ReplyTracker {
    expect: VecDeque<Expect>,
    /// `Exec` entries in `expect`.
    execs: usize,
    /// `Exec` entries in `expect` ahead of its last `Sync`: always its
    /// first `Exec` entries, since later ones were sent after that Sync.
    execs_before_sync: usize,
    /// An error was read; the server skips everything up to the next Sync.
    skipping: bool,
    /// A Parse failed and no Execute has reported it yet.
    parse_error: Option<DbError>,
    first_sum: i64,
    ready: VecDeque<Reply>,
    /// Statements sent since the last Sync.
    unsynced: bool,
    /// Transaction status of the last ReadyForQuery: b'I', b'T' or b'E'.
    status: u8,
}

impl Default for ReplyTracker {
    fn default() -> Self {
        ReplyTracker {
            expect: VecDeque::new(),
            execs: 0,
            execs_before_sync: 0,
            skipping: false,
            parse_error: None,
            first_sum: 0,
            ready: VecDeque::new(),
            unsynced: false,
            status: b'I',
        }
    }
}

impl ReplyTracker {
    pub fn sent_parse(&mut self) {
        self.push(Expect::Parse);
        self.unsynced = true;
    }

    pub fn sent_exec(&mut self) {
        self.push(Expect::Exec);
        self.unsynced = true;
    }

    fn push(&mut self, e: Expect) {
        match e {
            Expect::Exec => self.execs += 1,
            // Every Exec owed now was sent before it.
            Expect::Sync => self.execs_before_sync = self.execs,
            Expect::Parse => {}
        }
        self.expect.push_back(e);
    }

    fn pop(&mut self) -> Option<Expect> {
        let e = self.expect.pop_front();
        if e == Some(Expect::Exec) {
            self.execs -= 1;
            self.execs_before_sync = self.execs_before_sync.saturating_sub(1);
        }
        e
    }

    /// Whether statements were sent since the last Sync.
    pub fn needs_sync(&self) -> bool {
        self.unsynced
    }

    /// Whether the next owed reply can only arrive after another Sync: no
    /// statement before the last Sync is still owed. While one is, its
    /// reply is on the way, and the statements sent since wait for the next
    /// Sync: so a Sync covers everything sent while the batch before it
    /// was being answered.
    pub fn next_needs_sync(&self) -> bool {
        self.ready.is_empty() && self.unsynced && self.execs > 0 && self.execs_before_sync == 0
    }

    pub fn sent_sync(&mut self) {
        self.push(Expect::Sync);
        self.unsynced = false;
    }

    /// Replies owed to executed statements (not yet returned by `take`).
    pub fn owed(&self) -> usize {
        self.ready.len() + self.execs
    }

    /// Nothing owed at all, the last Sync's ReadyForQuery included.
    pub fn idle(&self) -> bool {
        self.expect.is_empty() && self.ready.is_empty() && !self.unsynced
    }

    pub fn status(&self) -> u8 {
        self.status
    }

    pub fn take(&mut self) -> Option<Reply> {
        self.ready.pop_front()
    }

    /// Reads one backend frame (asynchronous ones are the caller's).
    pub fn on_frame(&mut self, tag: u8, body: &[u8]) -> Result<(), ClientError> {
        let during = "in a pipelined batch";
        match tag {
            b'1' => match self.pop_until_sync_front() {
                Some(Expect::Parse) => {}
                _ => return Err(codec::unexpected(tag, during)),
            },
            // Bind went through; the Execute's outcome follows.
            b'2' if self.front() == Some(Expect::Exec) && !self.skipping => {}
            b'D' if self.front() == Some(Expect::Exec) && !self.skipping => {
                let row = codec::parse_data_row(body)?;
                if let Some(Some(v)) = row.first()
                    && let Ok(n) = v.parse::<i64>()
                {
                    self.first_sum = self.first_sum.saturating_add(n);
                }
            }
            b'C' | b'I' if self.front() == Some(Expect::Exec) && !self.skipping => {
                let rows = if tag == b'C' { command_rows(body) } else { 0 };
                self.pop();
                let first_sum = std::mem::take(&mut self.first_sum);
                self.ready.push_back(Reply::Done { rows, first_sum });
            }
            b'E' if !self.skipping => {
                let err = DbError::from(codec::parse_fields(body)?);
                self.first_sum = 0;
                self.skipping = true;
                match self.pop() {
                    Some(Expect::Parse) => self.parse_error = Some(err),
                    Some(Expect::Exec) => self.ready.push_back(Reply::Failed(err)),
                    // An error answering a Sync (the server's own failure to
                    // end an implicit transaction): owed to nobody.
                    Some(Expect::Sync) => {
                        self.skipping = false;
                        self.expect.push_front(Expect::Sync);
                    }
                    None => return Err(codec::unexpected(tag, during)),
                }
            }
            b'Z' => {
                // Everything before the Sync was skipped.
                loop {
                    match self.pop() {
                        Some(Expect::Sync) => break,
                        Some(Expect::Exec) if self.skipping => {
                            let r = match self.parse_error.take() {
                                Some(e) => Reply::Failed(e),
                                None => Reply::Skipped,
                            };
                            self.ready.push_back(r);
                        }
                        Some(Expect::Parse) if self.skipping => {}
                        _ => return Err(codec::unexpected(tag, during)),
                    }
                }
                self.skipping = false;
                self.parse_error = None;
                self.status = body.first().copied().unwrap_or(b'I');
            }
            _ => return Err(codec::unexpected(tag, during)),
        }
        Ok(())
    }

    fn front(&self) -> Option<Expect> {
        self.expect.front().copied()
    }

    fn pop_until_sync_front(&mut self) -> Option<Expect> {
        if self.skipping {
            return None;
        }
        self.pop()
    }
}

/// The row count at the end of a command tag ("INSERT 0 5", "SELECT 1").
fn command_rows(body: &[u8]) -> u64 {
    let tag = body.strip_suffix(&[0]).unwrap_or(body);
    std::str::from_utf8(tag)
        .ok()
        .and_then(|t| t.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// An ErrorResponse's fields, or, for a FATAL (or PANIC), the error: it
/// ends the session, so nothing else is waited for.
fn fatal(body: &[u8]) -> Result<ServerFields, ClientError> {
    let f = codec::parse_fields(body)?;
    if f.severity == "ERROR" {
        return Ok(f);
    }
    Err(ClientError::Server {
        severity: f.severity,
        code: f.code,
        message: f.message,
        detail: f.detail,
    })
}

/// Queues Bind (unnamed portal, results in text) and Execute of `statement`.
fn bind_execute<'a>(
    buf: &mut BytesMut,
    statement: &str,
    values: impl IntoIterator<Item = Value<'a>> + Clone,
) -> Result<(), ClientError> {
    // A message that fails half-written must not stay in the buffer.
    let base = buf.len();
    let formats: Vec<i16> = values
        .clone()
        .into_iter()
        .map(|(binary, _)| i16::from(binary))
        .collect();
    let r = frontend::bind(
        "",
        statement,
        formats,
        values,
        |(_, v), buf: &mut BytesMut| {
            Ok(match v {
                Some(bytes) => {
                    buf.extend_from_slice(bytes);
                    postgres_protocol::IsNull::No
                }
                None => postgres_protocol::IsNull::Yes,
            })
        },
        std::iter::empty::<i16>(),
        buf,
    );
    let why = match r {
        Ok(()) => match frontend::execute("", 0, buf) {
            Ok(()) => return Ok(()),
            Err(e) => e.to_string(),
        },
        Err(frontend::BindError::Conversion(e)) => e.to_string(),
        Err(frontend::BindError::Serialization(e)) => e.to_string(),
    };
    buf.truncate(base);
    Err(ClientError::protocol(format!(
        "cannot bind {statement}: {why}"
    )))
}

/// Queued statements are written when this much is waiting, when the
/// oldest has waited `WRITE_AFTER`, or when replies are waited for.
const WRITE_AT: usize = 32 * 1024;

/// How long a queued statement may wait to be written while its sender
/// keeps busy: a stream that never pauses must not hold its statements
/// (and their commits) back.
pub const WRITE_AFTER: std::time::Duration = std::time::Duration::from_millis(1);

/// A session whose statements are pipelined under one Sync per batch.
///
/// Every method is cancel-safe: bytes to send stay queued until the socket
/// took them, frames read stay buffered until processed, and processing a
/// frame is synchronous.
pub struct PipelinedSession {
    conn: Connection,
    session: Session,
    tracker: ReplyTracker,
    /// When the oldest unwritten message was queued.
    queued_since: Option<std::time::Instant>,
}

impl std::fmt::Debug for PipelinedSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelinedSession")
            .field("peer", &self.conn.peer)
            .field("backend_pid", &self.session.backend_pid)
            .finish()
    }
}

/// A parameter: `None` is NULL; `binary` picks the format of its bytes.
pub type Value<'a> = (bool, Option<&'a [u8]>);

impl PipelinedSession {
    /// An ordinary backend session (no `replication` startup parameter).
    pub async fn connect(config: &ReplicationConfig) -> Result<PipelinedSession, ClientError> {
        let (conn, session) = super::connect_any(config, false).await?;
        Ok(PipelinedSession {
            conn,
            session,
            tracker: ReplyTracker::default(),
            queued_since: None,
        })
    }

    pub fn backend_pid(&self) -> Option<i32> {
        self.session.backend_pid
    }

    /// Queues a Parse of a named statement; parameter types are inferred
    /// by the server, as for a Parse without types.
    pub fn parse(&mut self, name: &str, sql: &str) -> Result<(), ClientError> {
        frontend::parse(name, sql, std::iter::empty(), self.conn.wbuf())
            .map_err(|e| ClientError::protocol(format!("cannot send statement: {e}")))?;
        self.queued_since
            .get_or_insert_with(std::time::Instant::now);
        self.tracker.sent_parse();
        Ok(())
    }

    /// Queues Bind and Execute of a parsed statement (results in text).
    pub fn execute<'a>(
        &mut self,
        name: &str,
        values: impl IntoIterator<Item = Value<'a>> + Clone,
    ) -> Result<(), ClientError> {
        bind_execute(self.conn.wbuf(), name, values)?;
        self.queued_since
            .get_or_insert_with(std::time::Instant::now);
        self.tracker.sent_exec();
        Ok(())
    }

    /// Writes queued messages once enough are waiting, or the oldest has
    /// waited `WRITE_AFTER` (without a Sync: the server runs them, and
    /// holds the replies).
    ///
    /// Never waits for the socket: what it does not take now stays queued
    /// for the next call or for the wait for replies. A caller outside its
    /// `select!` (the stream's reader) must not block on a backend that is
    /// itself waiting, say for a user's lock, or its feedback stops.
    pub async fn send_some(&mut self) -> Result<(), ClientError> {
        let due = self
            .queued_since
            .is_some_and(|t| t.elapsed() >= WRITE_AFTER);
        if due || self.conn.wbuf().len() >= WRITE_AT {
            // Cancel-safe: bytes leave the buffer only once written.
            if let Some(r) = futures_util::FutureExt::now_or_never(self.write()) {
                r?;
            }
        }
        Ok(())
    }

    /// Writes everything queued now, waiting for the socket (no Sync).
    /// For sessions whose statements another session may wait for in the
    /// server (apply lanes): a statement still queued here when the agent
    /// waits for that other session would never run.
    pub async fn send_all(&mut self) -> Result<(), ClientError> {
        self.write().await
    }

    /// Ends the batch now: a Sync after what was sent, and everything
    /// written. After an error the server skips to the next Sync; a
    /// statement that must run whatever failed before it (apply lanes
    /// letting go of their locks) goes after this.
    pub async fn sync(&mut self) -> Result<(), ClientError> {
        self.sync_and_send().await
    }

    async fn write(&mut self) -> Result<(), ClientError> {
        self.conn.flush().await?;
        self.queued_since = None;
        Ok(())
    }

    /// Replies owed to executed statements.
    pub fn owed(&self) -> usize {
        self.tracker.owed()
    }

    /// The transaction status of the last batch's end: b'I' idle, b'T' in
    /// a transaction block, b'E' in a failed one.
    pub fn status(&self) -> u8 {
        self.tracker.status()
    }

    /// The next statement's outcome, in the order sent. Sends a Sync first
    /// if the statements owed are not followed by one yet.
    pub async fn next_reply(&mut self) -> Result<Reply, ClientError> {
        loop {
            if let Some(r) = self.tracker.take() {
                return Ok(r);
            }
            if self.tracker.owed() == 0 {
                return Err(ClientError::protocol("no statement is waiting for a reply"));
            }
            if self.tracker.next_needs_sync() {
                self.sync_and_send().await?;
            } else {
                // Whatever is queued goes out meanwhile (it runs, and is
                // answered after the next Sync).
                self.write().await?;
            }
            self.read_one().await?;
        }
    }

    /// Reads until nothing is owed, the last ReadyForQuery included, and
    /// returns the replies not taken yet.
    pub async fn finish(&mut self) -> Result<Vec<Reply>, ClientError> {
        self.sync_and_send().await?;
        while !self.tracker.expect.is_empty() {
            self.read_one().await?;
        }
        Ok(std::iter::from_fn(|| self.tracker.take()).collect())
    }

    /// Runs one statement on an idle session (a round trip), with text
    /// parameters, and returns its rows in text.
    pub async fn query(
        &mut self,
        sql: &str,
        params: &[Option<&str>],
    ) -> Result<Vec<Vec<Option<String>>>, ClientError> {
        if !self.tracker.idle() {
            return Err(ClientError::protocol(
                "query on a session with statements in flight",
            ));
        }
        frontend::parse("", sql, std::iter::empty(), self.conn.wbuf())
            .map_err(|e| ClientError::protocol(format!("cannot send statement: {e}")))?;
        let values = params.iter().map(|p| (false, p.map(str::as_bytes)));
        bind_execute(self.conn.wbuf(), "", values)?;
        frontend::sync(self.conn.wbuf());
        self.write().await?;
        let mut rows = Vec::new();
        let mut error = None;
        loop {
            let frame = self.conn.read_reply(&mut self.session).await?;
            match frame.tag {
                b'1' | b'2' | b'C' | b'I' | b'n' => {}
                b'D' => rows.push(codec::parse_data_row(&frame.body)?),
                b'E' => error = Some(DbError::from(fatal(&frame.body)?)),
                b'Z' => {
                    self.tracker.status = frame.body.first().copied().unwrap_or(b'I');
                    break;
                }
                tag => return Err(codec::unexpected(tag, "answering a query")),
            }
        }
        match error {
            Some(e) => Err(ClientError::Server {
                severity: e.severity,
                code: e.code,
                message: e.message,
                detail: e.detail,
            }),
            None => Ok(rows),
        }
    }

    async fn sync_and_send(&mut self) -> Result<(), ClientError> {
        self.end_batch();
        self.write().await
    }

    /// Ends the batch without writing: a Sync queued after what was
    /// queued, so what comes next starts outside any implicit transaction
    /// block (a procedure that commits inside must, or its COMMIT fails).
    pub fn end_batch(&mut self) {
        if self.tracker.needs_sync() {
            frontend::sync(self.conn.wbuf());
            self.tracker.sent_sync();
        }
    }

    async fn read_one(&mut self) -> Result<(), ClientError> {
        let frame = self.conn.read_reply(&mut self.session).await?;
        if frame.tag == b'E' {
            fatal(&frame.body)?;
        }
        self.tracker.on_frame(frame.tag, &frame.body)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn err(code: &str) -> Vec<u8> {
        let mut b = Vec::new();
        for (k, v) in [
            (b'V', "ERROR"),
            (b'C', code),
            (b'M', "boom"),
            (b'n', "mm_conflict"),
        ] {
            b.push(k);
            b.extend_from_slice(v.as_bytes());
            b.push(0);
        }
        b.push(0);
        b
    }

    fn row(v: &str) -> Vec<u8> {
        let mut b = vec![0, 1];
        b.extend_from_slice(&(v.len() as i32).to_be_bytes());
        b.extend_from_slice(v.as_bytes());
        b
    }

    fn drain(t: &mut ReplyTracker) -> Vec<Reply> {
        std::iter::from_fn(|| t.take()).collect()
    }

    /// What the counts stand for, found by walking the queue.
    fn walked(t: &ReplyTracker) -> (usize, bool) {
        let owed = t.ready.len() + t.expect.iter().filter(|e| **e == Expect::Exec).count();
        let first_exec = t.expect.iter().position(|e| *e == Expect::Exec);
        let last_sync = t.expect.iter().rposition(|e| *e == Expect::Sync);
        let behind_last_sync = match (first_exec, last_sync) {
            (Some(x), Some(s)) => x > s,
            (Some(_), None) => true,
            (None, _) => false,
        };
        (owed, t.ready.is_empty() && t.unsynced && behind_last_sync)
    }

    proptest::proptest! {
        /// Statements and Syncs sent, and the server's answers to them
        /// (successes and errors) read, in any interleaving: the counts
        /// always say what a walk of the queue says.
        #[test]
        fn the_counts_agree_with_the_queue(ops in proptest::collection::vec(0u8..7, 0..200)) {
            let mut t = ReplyTracker::default();
            for op in ops {
                match op {
                    0 => t.sent_parse(),
                    1 | 2 => t.sent_exec(),
                    3 => t.sent_sync(),
                    4 => {
                        let _ = t.take();
                    }
                    // The server answers the oldest owed message: it
                    // succeeds (5) or fails (6).
                    _ => {
                        let (tag, body): (u8, Vec<u8>) = match (t.front(), t.skipping, op) {
                            (None, ..) => continue,
                            (Some(Expect::Sync), ..) | (Some(_), true, _) => {
                                if !t.expect.contains(&Expect::Sync) {
                                    continue;
                                }
                                (b'Z', b"I".to_vec())
                            }
                            (Some(_), false, 6) => (b'E', err("22P02")),
                            (Some(Expect::Parse), false, _) => (b'1', Vec::new()),
                            (Some(Expect::Exec), false, _) => (b'C', b"INSERT 0 1\0".to_vec()),
                        };
                        t.on_frame(tag, &body).unwrap();
                    }
                }
                proptest::prop_assert_eq!((t.owed(), t.next_needs_sync()), walked(&t));
            }
        }
    }

    #[test]
    fn a_batch_answers_each_statement_in_order() {
        let mut t = ReplyTracker::default();
        t.sent_parse();
        t.sent_exec();
        t.sent_exec();
        assert!(t.needs_sync());
        t.sent_sync();
        assert_eq!(t.owed(), 2);
        t.on_frame(b'1', b"").unwrap();
        t.on_frame(b'2', b"").unwrap();
        t.on_frame(b'D', &row("2")).unwrap();
        t.on_frame(b'D', &row("3")).unwrap();
        t.on_frame(b'C', b"SELECT 2\0").unwrap();
        t.on_frame(b'2', b"").unwrap();
        t.on_frame(b'C', b"INSERT 0 7\0").unwrap();
        assert!(!t.idle(), "ReadyForQuery still owed");
        t.on_frame(b'Z', b"T").unwrap();
        assert_eq!(
            drain(&mut t),
            vec![
                Reply::Done {
                    rows: 2,
                    first_sum: 5
                },
                Reply::Done {
                    rows: 7,
                    first_sum: 0
                }
            ]
        );
        assert!(t.idle());
        assert_eq!(t.status(), b'T');
    }

    #[test]
    fn a_sync_covers_what_was_sent_while_the_batch_before_was_answered() {
        let mut t = ReplyTracker::default();
        assert!(!t.next_needs_sync());
        t.sent_exec();
        assert!(t.next_needs_sync());
        t.sent_sync();
        assert!(!t.next_needs_sync());
        t.sent_exec();
        t.sent_exec();
        // The first batch's reply is still on the way: no Sync yet.
        assert!(!t.next_needs_sync());
        t.on_frame(b'2', b"").unwrap();
        t.on_frame(b'C', b"SELECT 1\0").unwrap();
        assert!(!t.next_needs_sync(), "a reply is ready to take");
        assert_eq!(
            t.take(),
            Some(Reply::Done {
                rows: 1,
                first_sum: 0
            })
        );
        assert!(t.next_needs_sync(), "only the unsynced batch is owed");
        t.on_frame(b'Z', b"I").unwrap();
        assert!(t.next_needs_sync());
        t.sent_sync();
        assert!(!t.next_needs_sync());
    }

    #[test]
    fn statements_after_an_error_are_skipped_until_the_sync() {
        let mut t = ReplyTracker::default();
        for _ in 0..3 {
            t.sent_exec();
        }
        t.sent_sync();
        t.sent_exec();
        t.sent_sync();
        t.on_frame(b'2', b"").unwrap();
        t.on_frame(b'C', b"UPDATE 1\0").unwrap();
        t.on_frame(b'E', &err("MM001")).unwrap();
        // Nothing for the third statement: the server skipped it.
        t.on_frame(b'Z', b"E").unwrap();
        // The next batch runs (and fails: the block is aborted).
        t.on_frame(b'E', &err("25P02")).unwrap();
        t.on_frame(b'Z', b"E").unwrap();
        let got = drain(&mut t);
        assert_eq!(
            got[0],
            Reply::Done {
                rows: 1,
                first_sum: 0
            }
        );
        match &got[1] {
            Reply::Failed(e) => {
                assert_eq!(e.code, "MM001");
                assert_eq!(e.constraint.as_deref(), Some("mm_conflict"));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(got[2], Reply::Skipped);
        assert!(matches!(&got[3], Reply::Failed(e) if e.code == "25P02"));
        assert_eq!(got.len(), 4);
        assert!(t.idle());
        assert_eq!(t.status(), b'E');
    }

    #[test]
    fn a_failed_parse_is_the_failure_of_the_statement_using_it() {
        let mut t = ReplyTracker::default();
        t.sent_parse();
        t.sent_exec();
        t.sent_exec();
        t.sent_sync();
        t.on_frame(b'E', &err("42601")).unwrap();
        t.on_frame(b'Z', b"I").unwrap();
        let got = drain(&mut t);
        assert!(matches!(&got[0], Reply::Failed(e) if e.code == "42601"));
        assert_eq!(got[1], Reply::Skipped);
    }

    #[test]
    fn frames_out_of_place_are_protocol_errors_not_panics() {
        let mut t = ReplyTracker::default();
        assert!(t.on_frame(b'C', b"SELECT 1\0").is_err());
        assert!(t.on_frame(b'Z', b"I").is_err());
        assert!(t.on_frame(b'1', b"").is_err());
        t.sent_exec();
        assert!(t.on_frame(b'D', &[0xff]).is_err());
        assert!(t.on_frame(b'E', b"C").is_err());
    }

    proptest::proptest! {
        /// Whatever a server (or a corrupted stream) sends, in whatever
        /// order, the tracker answers with replies or a protocol error,
        /// never a panic, and never more replies than statements sent.
        #[test]
        fn arbitrary_frames_never_panic(
            sent in proptest::collection::vec(0u8..3, 0..12),
            frames in proptest::collection::vec(
                (proptest::sample::select(b"123CDEIZnsNt".to_vec()),
                 proptest::collection::vec(proptest::prelude::any::<u8>(), 0..24)),
                0..24,
            ),
        ) {
            let mut t = ReplyTracker::default();
            let mut execs = 0;
            for k in sent {
                match k {
                    0 => t.sent_parse(),
                    1 => {
                        t.sent_exec();
                        execs += 1;
                    }
                    _ => t.sent_sync(),
                }
            }
            let mut replies = 0;
            for (tag, body) in frames {
                if t.on_frame(tag, &body).is_err() {
                    break;
                }
                while t.take().is_some() {
                    replies += 1;
                }
            }
            proptest::prop_assert!(replies <= execs);
        }
    }

    #[test]
    fn command_tags_give_their_row_count() {
        assert_eq!(command_rows(b"INSERT 0 5\0"), 5);
        assert_eq!(command_rows(b"SELECT 1\0"), 1);
        assert_eq!(command_rows(b"BEGIN\0"), 0);
        assert_eq!(command_rows(b""), 0);
    }
}
