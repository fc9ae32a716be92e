//! A `replication=database` connection on `postgres-protocol` + tokio.
//!
//! tokio-postgres cannot enter CopyBoth mode, which START_REPLICATION needs,
//! so this client speaks the few messages involved itself: startup, auth
//! (trust / cleartext / md5 / SCRAM-SHA-256), optional TLS, the replication
//! commands, simple queries, and the streaming phase.
//!
//! Every identifier put into a replication command (slot names, option
//! names) is quoted as an identifier and every option value as a literal:
//! they are data, never command text.

mod auth;
mod codec;
mod config;
mod connection;
mod error;
mod pipelined;
mod sockopt;
mod sql;
mod stream;
mod tls;

use std::sync::Arc;

pub use config::{Host, ReplicationConfig, SslMode, TlsVersion};
pub use error::{
    ClientError, SQLSTATE_DUPLICATE_OBJECT, SQLSTATE_INVALID_PASSWORD, SQLSTATE_OBJECT_IN_USE,
    SQLSTATE_UNDEFINED_OBJECT,
};
pub use pipelined::{DbError, PipelinedSession, Reply, ReplyTracker, Value};
pub use sql::{RustlsConnect, RustlsConnectOne, RustlsStream};
pub use stream::LogicalReplicationStream;

use crate::Lsn;
use connection::{Connection, Session};

/// Result of IDENTIFY_SYSTEM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdentifySystem {
    /// The cluster's system identifier (a u64 printed in decimal): tells
    /// apart clusters that share a name, and changes on re-initdb.
    pub systemid: String,
    pub timeline: u32,
    /// Current WAL flush position.
    pub xlogpos: Lsn,
    pub dbname: Option<String>,
}

/// What CREATE_REPLICATION_SLOT does with the snapshot it builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotAction {
    /// Export it for `SET TRANSACTION SNAPSHOT`; valid while this connection
    /// stays open and runs no other command.
    Export,
    NoExport,
    /// Use it in the current transaction of this connection (needs BEGIN
    /// ISOLATION LEVEL REPEATABLE READ READ ONLY on it first).
    Use,
}

impl SnapshotAction {
    fn keyword(self) -> &'static str {
        match self {
            SnapshotAction::Export => "export",
            SnapshotAction::NoExport => "nothing",
            SnapshotAction::Use => "use",
        }
    }
}

/// Result of CREATE_REPLICATION_SLOT.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreatedSlot {
    pub slot_name: String,
    /// Every transaction committing after this point is decoded by the slot;
    /// the exported snapshot holds exactly those before it.
    pub consistent_point: Lsn,
    pub snapshot_name: Option<String>,
    pub output_plugin: Option<String>,
}

/// One row of a simple query result; every value is text, NULL is `None`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimpleRow {
    columns: Arc<[String]>,
    values: Vec<Option<String>>,
}

impl SimpleRow {
    pub fn columns(&self) -> &[String] {
        &self.columns
    }

    pub fn values(&self) -> &[Option<String>] {
        &self.values
    }

    pub fn len(&self) -> usize {
        self.values.len()
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// Column `idx`; `None` for NULL or a missing column.
    pub fn get(&self, idx: usize) -> Option<&str> {
        self.values.get(idx).and_then(|v| v.as_deref())
    }

    /// The column named `name`; `None` for NULL or a missing column.
    pub fn get_by_name(&self, name: &str) -> Option<&str> {
        let idx = self.columns.iter().position(|c| c == name)?;
        self.get(idx)
    }

    /// The column named `name`, distinguishing NULL (`Ok(None)`) from a
    /// column the result does not have (an error naming it).
    pub fn try_get(&self, name: &str) -> Result<Option<&str>, ClientError> {
        let idx = self
            .columns
            .iter()
            .position(|c| c == name)
            .ok_or_else(|| ClientError::protocol(format!("result has no column {name:?}")))?;
        Ok(self.get(idx))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Idle,
    /// A command is in flight. Seen at the start of a call, it means the
    /// previous call's future was dropped mid-exchange, leaving unread
    /// responses on the wire: the connection cannot be trusted any more.
    Busy,
    Broken(String),
}

/// An idle replication connection, ready for commands.
///
/// Methods other than `start_logical_replication` are not cancel-safe: a
/// dropped call leaves the connection unusable (later calls fail instead of
/// misreading responses).
pub struct ReplicationClient {
    conn: Connection,
    session: Session,
    state: State,
    /// Set once a logical stream ran on this connection. The walsender only
    /// resets its end-of-streaming flags for physical replication, so a
    /// second logical START_REPLICATION would end at once (PostgreSQL 15-18).
    streamed: bool,
}

impl std::fmt::Debug for ReplicationClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicationClient")
            .field("peer", &self.conn.peer)
            .field("tls", &self.conn.tls)
            .field("backend_pid", &self.session.backend_pid)
            .field("state", &self.state)
            .finish()
    }
}

impl ReplicationClient {
    /// Connects, trying each host of the config in order (each attempt
    /// bounded by `connect_timeout`), and returns the last error if none works.
    pub async fn connect(config: &ReplicationConfig) -> Result<ReplicationClient, ClientError> {
        let (conn, session) = connect_any(config, true).await?;
        Ok(ReplicationClient::from_parts(conn, session))
    }

    pub(crate) fn from_parts(conn: Connection, session: Session) -> ReplicationClient {
        ReplicationClient {
            conn,
            session,
            state: State::Idle,
            streamed: false,
        }
    }

    pub(crate) fn after_stream(conn: Connection, session: Session) -> ReplicationClient {
        ReplicationClient {
            streamed: true,
            ..ReplicationClient::from_parts(conn, session)
        }
    }

    /// A server parameter reported at startup or since (`server_version`,
    /// `server_encoding`, `DateStyle`, `TimeZone`, ...).
    pub fn parameter(&self, name: &str) -> Option<&str> {
        self.session.params.get(name).map(String::as_str)
    }

    /// The server's version string, e.g. "18.6".
    pub fn server_version(&self) -> Option<&str> {
        self.parameter("server_version")
    }

    /// The server version as PostgreSQL's `server_version_num` (180006 for
    /// 18.6; 160000 for "16beta1"), parsed from `server_version`.
    pub fn server_version_num(&self) -> Option<u32> {
        parse_server_version_num(self.server_version()?)
    }

    pub fn is_tls(&self) -> bool {
        self.conn.tls
    }

    /// The walsender's process id on the server (for pg_stat_replication).
    pub fn backend_pid(&self) -> Option<i32> {
        self.session.backend_pid
    }

    /// Runs one or more SQL or replication commands with the simple query
    /// protocol, returning the rows of all of them in order. On an error the
    /// remaining responses are consumed, so the connection stays usable.
    pub async fn simple_query(&mut self, sql: &str) -> Result<Vec<SimpleRow>, ClientError> {
        self.begin()?;
        let result = self.run_query(sql).await;
        self.end(&result);
        result
    }

    fn begin(&mut self) -> Result<(), ClientError> {
        match &self.state {
            State::Idle => {
                self.state = State::Busy;
                Ok(())
            }
            State::Busy => {
                let why = "an earlier call was cancelled mid-exchange".to_owned();
                self.state = State::Broken(why.clone());
                Err(ClientError::protocol(format!("connection unusable: {why}")))
            }
            State::Broken(why) => Err(ClientError::protocol(format!("connection unusable: {why}"))),
        }
    }

    fn end<T>(&mut self, result: &Result<T, ClientError>) {
        self.state = match result {
            Ok(_) => State::Idle,
            // Only a server ERROR leaves the protocol in a known state (we
            // read through ReadyForQuery); anything else desynchronizes it.
            Err(e @ ClientError::Server { .. }) if !e.is_fatal() => State::Idle,
            Err(e) => State::Broken(e.to_string()),
        };
    }

    async fn run_query(&mut self, sql: &str) -> Result<Vec<SimpleRow>, ClientError> {
        self.conn.queue_query(sql)?;
        self.conn.flush().await?;
        let mut rows = Vec::new();
        let mut columns: Option<Arc<[String]>> = None;
        let mut error = None;
        loop {
            let frame = self.conn.read_reply(&mut self.session).await?;
            match frame.tag {
                b'T' => columns = Some(codec::parse_row_description(&frame.body)?.into()),
                b'D' => {
                    let cols = columns
                        .clone()
                        .ok_or_else(|| ClientError::protocol("DataRow before RowDescription"))?;
                    let values = codec::parse_data_row(&frame.body)?;
                    if values.len() != cols.len() {
                        return Err(ClientError::protocol(format!(
                            "DataRow has {} values for {} columns",
                            values.len(),
                            cols.len()
                        )));
                    }
                    rows.push(SimpleRow {
                        columns: cols,
                        values,
                    });
                }
                b'C' => columns = None,
                b'I' => {}
                b'E' => {
                    let e = codec::server_error(&frame.body);
                    if e.is_fatal() {
                        return Err(e);
                    }
                    error.get_or_insert(e);
                }
                b'G' => {
                    // COPY FROM STDIN: refuse, the server then reports an error.
                    postgres_protocol::message::frontend::copy_fail(
                        "COPY FROM STDIN is not supported by simple_query",
                        self.conn.wbuf(),
                    )
                    .map_err(|e| ClientError::protocol(format!("encoding CopyFail: {e}")))?;
                    self.conn.flush().await?;
                }
                b'H' => {
                    // COPY TO STDOUT: drain it, report it as unsupported.
                    loop {
                        let f = self.conn.read_frame().await?;
                        match f.tag {
                            b'd' | b'N' | b'S' => {}
                            b'c' => break,
                            b'E' => {
                                error.get_or_insert(codec::server_error(&f.body));
                                break;
                            }
                            tag => return Err(codec::unexpected(tag, "during COPY TO STDOUT")),
                        }
                    }
                    error.get_or_insert(ClientError::protocol(
                        "COPY TO STDOUT is not supported by simple_query",
                    ));
                }
                b'W' => {
                    return Err(ClientError::protocol(
                        "simple_query started streaming (CopyBoth); use start_logical_replication",
                    ));
                }
                b'Z' => break,
                tag => return Err(codec::unexpected(tag, "in a simple query response")),
            }
        }
        match error {
            Some(e) => Err(e),
            None => Ok(rows),
        }
    }

    /// IDENTIFY_SYSTEM: the server's system id, timeline and WAL position.
    pub async fn identify_system(&mut self) -> Result<IdentifySystem, ClientError> {
        let rows = self.simple_query("IDENTIFY_SYSTEM").await?;
        let row = single_row(&rows, "IDENTIFY_SYSTEM")?;
        let systemid = required(row, "systemid")?.to_owned();
        let timeline = required(row, "timeline")?.parse().map_err(|_| {
            ClientError::protocol("IDENTIFY_SYSTEM returned a non-numeric timeline")
        })?;
        let xlogpos = parse_lsn(required(row, "xlogpos")?, "IDENTIFY_SYSTEM xlogpos")?;
        Ok(IdentifySystem {
            systemid,
            timeline,
            xlogpos,
            dbname: row.try_get("dbname")?.map(str::to_owned),
        })
    }

    /// CREATE_REPLICATION_SLOT "name" [TEMPORARY] LOGICAL "plugin" (SNAPSHOT '...'),
    /// the PostgreSQL >= 15 syntax.
    ///
    /// With `SnapshotAction::Export` the returned snapshot name stays valid
    /// only while this client stays open and idle: keep it alive (and do not
    /// send further commands on it) until every `SET TRANSACTION SNAPSHOT`
    /// has run. A temporary slot disappears with this connection.
    pub async fn create_logical_slot(
        &mut self,
        name: &str,
        plugin: &str,
        snapshot: SnapshotAction,
        temporary: bool,
    ) -> Result<CreatedSlot, ClientError> {
        let cmd = format!(
            "CREATE_REPLICATION_SLOT {}{} LOGICAL {} (SNAPSHOT {})",
            quote_ident(name),
            if temporary { " TEMPORARY" } else { "" },
            quote_ident(plugin),
            quote_literal(snapshot.keyword()),
        );
        let rows = self.simple_query(&cmd).await?;
        let row = single_row(&rows, "CREATE_REPLICATION_SLOT")?;
        Ok(CreatedSlot {
            slot_name: required(row, "slot_name")?.to_owned(),
            consistent_point: parse_lsn(
                required(row, "consistent_point")?,
                "CREATE_REPLICATION_SLOT consistent_point",
            )?,
            snapshot_name: row.try_get("snapshot_name")?.map(str::to_owned),
            output_plugin: row.try_get("output_plugin")?.map(str::to_owned),
        })
    }

    /// DROP_REPLICATION_SLOT. With `wait`, blocks while another walsender
    /// uses the slot instead of failing with SQLSTATE 55006. A missing slot
    /// fails with SQLSTATE 42704.
    pub async fn drop_slot(&mut self, name: &str, wait: bool) -> Result<(), ClientError> {
        let cmd = format!(
            "DROP_REPLICATION_SLOT {}{}",
            quote_ident(name),
            if wait { " WAIT" } else { "" }
        );
        self.simple_query(&cmd).await.map(|_| ())
    }

    /// START_REPLICATION SLOT "slot" LOGICAL start ("name" 'value', ...).
    ///
    /// `start` = `Lsn::INVALID` resumes at the slot's confirmed_flush_lsn; a
    /// position below it is also resumed from there (the server never
    /// re-sends confirmed data). For pgoutput pass e.g. `[("proto_version",
    /// "4"), ("publication_names", "\"mm\""), ("origin", "none"), ("streaming",
    /// "on"), ("messages", "true")]`.
    pub async fn start_logical_replication(
        mut self,
        slot: &str,
        start: Lsn,
        options: &[(&str, &str)],
    ) -> Result<LogicalReplicationStream, ClientError> {
        if self.streamed {
            return Err(ClientError::protocol(
                "this connection already streamed once; PostgreSQL cannot start logical \
                 replication twice on one connection, reconnect",
            ));
        }
        let mut cmd = format!(
            "START_REPLICATION SLOT {} LOGICAL {start}",
            quote_ident(slot)
        );
        if !options.is_empty() {
            let opts: Vec<String> = options
                .iter()
                .map(|(k, v)| format!("{} {}", quote_ident(k), quote_literal(v)))
                .collect();
            cmd.push_str(" (");
            cmd.push_str(&opts.join(", "));
            cmd.push(')');
        }
        self.begin()?;
        self.conn.queue_query(&cmd)?;
        self.conn.flush().await?;
        let frame = self.conn.read_reply(&mut self.session).await?;
        match frame.tag {
            b'W' => Ok(LogicalReplicationStream::new(self.conn, self.session)),
            // The error is followed by ReadyForQuery, but the client is
            // consumed anyway: callers reconnect to retry.
            b'E' => Err(codec::server_error(&frame.body)),
            tag => Err(codec::unexpected(tag, "in response to START_REPLICATION")),
        }
    }

    /// Sends Terminate and closes the socket. Dropping the client also
    /// closes it, only less politely (the server logs an unexpected EOF).
    pub async fn close(self) {
        self.conn.terminate().await;
    }
}

fn single_row<'a>(rows: &'a [SimpleRow], cmd: &str) -> Result<&'a SimpleRow, ClientError> {
    match rows {
        [row] => Ok(row),
        _ => Err(ClientError::protocol(format!(
            "{cmd} returned {} rows, expected 1",
            rows.len()
        ))),
    }
}

fn required<'a>(row: &'a SimpleRow, name: &str) -> Result<&'a str, ClientError> {
    row.try_get(name)?
        .ok_or_else(|| ClientError::protocol(format!("column {name:?} is NULL")))
}

fn parse_lsn(s: &str, what: &str) -> Result<Lsn, ClientError> {
    s.parse()
        .map_err(|_| ClientError::protocol(format!("{what} is not an LSN: {s:?}")))
}

fn parse_server_version_num(v: &str) -> Option<u32> {
    let numeric: String = v
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    let mut parts = numeric.split('.').filter(|p| !p.is_empty());
    let major: u32 = parts.next()?.parse().ok()?;
    let minor: u32 = parts.next().map_or(Some(0), |p| p.parse().ok())?;
    if major >= 10 {
        Some(major * 10_000 + minor)
    } else {
        // 9.6.24 -> 90624
        let patch: u32 = parts.next().map_or(Some(0), |p| p.parse().ok())?;
        Some(major * 10_000 + minor * 100 + patch)
    }
}

/// Quotes an identifier for the replication command grammar (and SQL):
/// double quotes, embedded ones doubled. Always quoted, so case and
/// keywords never change meaning.
pub(crate) fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Quotes a string literal for the replication command grammar, which
/// (like SQL with standard_conforming_strings) knows no backslash escapes:
/// only single quotes need doubling.
pub(crate) fn quote_literal(value: &str) -> String {
    format!("'{}'", value.replace('\'', "''"))
}

/// Connects, trying each host of the config in order (each attempt bounded
/// by `connect_timeout`), and returns the last error if none works.
/// `replication`: a walsender (`replication=database`) or an ordinary
/// backend (`pipelined.rs`).
pub(crate) async fn connect_any(
    config: &ReplicationConfig,
    replication: bool,
) -> Result<(Connection, Session), ClientError> {
    config.validate()?;
    let user = config
        .user()
        .ok_or_else(|| ClientError::Config("no user given (set user=...)".into()))?;
    let mut last_error = None;
    for target in config.targets()? {
        let attempt = connection::connect_target(config, &target, user, replication);
        let result = match config.connect_timeout() {
            Some(limit) => match tokio::time::timeout(limit, attempt).await {
                Ok(r) => r,
                Err(_) => Err(ClientError::io(
                    format!("connecting to {:?} port {}", target.host, target.port),
                    std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("connect_timeout of {}s expired", limit.as_secs()),
                    ),
                )),
            },
            None => attempt.await,
        };
        match result {
            Ok(parts) => return Ok(parts),
            // Authentication and TLS verification failures would repeat
            // on every host of the same cluster, but libpq tries them all
            // too: the next host may be configured differently.
            Err(e) => {
                tracing::debug!(host = ?target.host, port = target.port, error = %e, "replication connect attempt failed");
                last_error = Some(e);
            }
        }
    }
    Err(last_error.unwrap_or_else(|| ClientError::Config("no host to connect to".into())))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// The agent moves clients and streams into spawned tasks and awaits
    /// `next()` inside `select!` there: all of it must be Send.
    #[test]
    fn futures_and_types_are_send() {
        fn is_send<T: Send>(_: &T) {}
        fn check(client: ReplicationClient, mut stream: LogicalReplicationStream) {
            is_send(&client);
            is_send(&stream.next());
            is_send(&ReplicationClient::connect(&ReplicationConfig::new()));
            is_send(&client.start_logical_replication("s", Lsn::INVALID, &[]));
        }
        let _ = check;
    }

    #[test]
    fn quoting() {
        assert_eq!(quote_ident("mm_a_to_b"), "\"mm_a_to_b\"");
        assert_eq!(quote_ident("we\"ird"), "\"we\"\"ird\"");
        assert_eq!(quote_literal("\"mm\""), "'\"mm\"'");
        assert_eq!(quote_literal("it's"), "'it''s'");
        assert_eq!(quote_literal("back\\slash"), "'back\\slash'");
    }

    #[test]
    fn version_numbers() {
        assert_eq!(parse_server_version_num("18.6"), Some(180_006));
        assert_eq!(parse_server_version_num("16beta1"), Some(160_000));
        assert_eq!(
            parse_server_version_num("17.2 (Debian 17.2-1)"),
            Some(170_002)
        );
        assert_eq!(parse_server_version_num("9.6.24"), Some(90_624));
        assert_eq!(parse_server_version_num("x"), None);
    }

    #[test]
    fn row_access() {
        let row = SimpleRow {
            columns: vec!["a".to_owned(), "b".to_owned()].into(),
            values: vec![Some("1".to_owned()), None],
        };
        assert_eq!(row.get(0), Some("1"));
        assert_eq!(row.get(1), None);
        assert_eq!(row.get(2), None);
        assert_eq!(row.get_by_name("a"), Some("1"));
        assert_eq!(row.try_get("b").unwrap(), None);
        assert!(row.try_get("c").is_err());
        assert_eq!(row.len(), 2);
    }
}
