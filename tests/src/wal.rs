//! Reading a live pgoutput stream in tests: a replication stream that keeps
//! the walsender happy (status updates), collects decoded messages up to a
//! chosen transaction's end, and renders messages as short stable strings so
//! a test can compare a whole decoded sequence with one `assert_eq!`.
//!
//! The rendering leaves out LSNs, xids and timestamps on purpose: they differ
//! on every run, so tests check them separately against what the server
//! reports, and the strings stay exact.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use mm_proto::Lsn;
use mm_proto::client::{LogicalReplicationStream, ReplicationClient, ReplicationConfig};
use mm_proto::pgoutput::{
    ColumnValue, KeyValue, Message, OldTuple, Relation, StreamTracker, TupleData,
};
use mm_proto::walsender::{ServerMessage, StandbyStatusUpdate, pg_now_micros};

/// The START_REPLICATION options the mm agent uses, publication `mm`.
pub const MM_OPTIONS: [(&str, &str); 5] = [
    ("proto_version", "4"),
    ("publication_names", "\"mm\""),
    ("origin", "none"),
    ("streaming", "on"),
    ("messages", "true"),
];

/// How often a status update goes out even if the server asks for none: well
/// under `wal_sender_timeout`, so a slow test never gets disconnected.
const STATUS_INTERVAL: Duration = Duration::from_secs(1);

/// One decoded XLogData message and where it came from.
#[derive(Debug, Clone)]
pub struct Received {
    /// XLogData's WAL start (the position of the record that produced it).
    pub wal_start: Lsn,
    /// The pgoutput payload as received.
    pub raw: Bytes,
    pub msg: Message,
}

/// A logical replication stream decoded with [`StreamTracker`], answering
/// keepalives and sending periodic status updates while it is read.
pub struct WalStream {
    stream: LogicalReplicationStream,
    tracker: StreamTracker,
    /// Highest server WAL end seen: reported as `write`.
    received: Lsn,
    /// What the test declared durable: reported as `flush` (0/0 = nothing,
    /// which the walsender ignores, so the slot never moves by accident).
    confirmed: Lsn,
    last_status: Instant,
    /// Transaction currently open (BEGIN or BEGIN PREPARE seen, not yet closed).
    open_xid: Option<u32>,
}

impl WalStream {
    /// Connects and starts streaming `slot` from its confirmed position.
    /// `options` must include `proto_version` 4 (the tracker assumes it) and
    /// not `streaming 'parallel'`.
    pub async fn start(
        config: &ReplicationConfig,
        slot: &str,
        options: &[(&str, &str)],
    ) -> Result<WalStream> {
        let client = ReplicationClient::connect(config)
            .await
            .context("connecting for replication")?;
        let stream = client
            .start_logical_replication(slot, Lsn::INVALID, options)
            .await
            .with_context(|| format!("START_REPLICATION of slot {slot}"))?;
        Ok(WalStream {
            stream,
            tracker: StreamTracker::new(4, false),
            received: Lsn::INVALID,
            confirmed: Lsn::INVALID,
            last_status: Instant::now(),
            open_xid: None,
        })
    }

    /// The next decoded message; keepalives are answered and skipped. Fails
    /// when `deadline` passes first, when the stream ends, or on a decode error.
    pub async fn next(&mut self, deadline: Instant) -> Result<Received> {
        loop {
            if self.last_status.elapsed() >= STATUS_INTERVAL {
                self.send_status().await?;
            }
            let wait = deadline
                .saturating_duration_since(Instant::now())
                .min(STATUS_INTERVAL);
            let next = match tokio::time::timeout(wait, self.stream.next()).await {
                Ok(m) => m,
                Err(_) if Instant::now() >= deadline => {
                    bail!("no replication message before the deadline")
                }
                Err(_) => continue,
            };
            match next {
                None => bail!("the server ended the replication stream"),
                Some(Err(e)) => return Err(e).context("reading the replication stream"),
                Some(Ok(ServerMessage::PrimaryKeepalive {
                    wal_end,
                    reply_requested,
                    ..
                })) => {
                    self.received = self.received.max(wal_end);
                    if reply_requested {
                        self.send_status().await?;
                    }
                }
                Some(Ok(ServerMessage::XLogData {
                    wal_start,
                    wal_end,
                    data,
                    ..
                })) => {
                    self.received = self.received.max(wal_end);
                    let msg = self
                        .tracker
                        .decode(data.clone())
                        .with_context(|| format!("decoding the message at {wal_start}"))?;
                    self.track_open(&msg);
                    return Ok(Received {
                        wal_start,
                        raw: data,
                        msg,
                    });
                }
            }
        }
    }

    fn track_open(&mut self, msg: &Message) {
        match msg {
            Message::Begin(b) => self.open_xid = Some(b.xid),
            Message::BeginPrepare(b) => self.open_xid = Some(b.xid),
            Message::Commit(_) | Message::Prepare(_) => self.open_xid = None,
            _ => {}
        }
    }

    /// Collects messages until `done` returns true for one (included).
    pub async fn collect_until(
        &mut self,
        timeout: Duration,
        mut done: impl FnMut(&Message) -> bool,
    ) -> Result<Vec<Received>> {
        let deadline = Instant::now() + timeout;
        let mut out = Vec::new();
        loop {
            let r = self.next(deadline).await.with_context(|| {
                format!(
                    "after {} messages: {:?}",
                    out.len(),
                    out.iter()
                        .rev()
                        .take(5)
                        .map(|r: &Received| r.msg.name())
                        .collect::<Vec<_>>()
                )
            })?;
            let finished = done(&r.msg);
            out.push(r);
            if finished {
                return Ok(out);
            }
        }
    }

    /// Collects messages up to and including the one that ends transaction
    /// `xid`: its COMMIT, STREAM COMMIT, STREAM ABORT, COMMIT PREPARED or
    /// ROLLBACK PREPARED.
    pub async fn collect_through_xid(
        &mut self,
        xid: u32,
        timeout: Duration,
    ) -> Result<Vec<Received>> {
        // The COMMIT carries no xid: it closes whatever BEGIN opened, which
        // `next` tracks; read it before `next` clears it.
        let deadline = Instant::now() + timeout;
        let mut out = Vec::new();
        loop {
            let open_before = self.open_xid;
            let r = self
                .next(deadline)
                .await
                .with_context(|| format!("waiting for the end of xid {xid}"))?;
            let finished = match &r.msg {
                Message::Commit(_) => open_before == Some(xid),
                Message::StreamCommit(c) => c.xid == xid,
                Message::StreamAbort(a) => a.xid == xid && a.subtransaction_xid == xid,
                Message::CommitPrepared(c) => c.xid == xid,
                Message::RollbackPrepared(r) => r.xid == xid,
                _ => false,
            };
            out.push(r);
            if finished {
                return Ok(out);
            }
        }
    }

    /// Declares everything up to `flush` durable and reports it at once: the
    /// walsender makes it the slot's confirmed_flush_lsn.
    pub async fn confirm(&mut self, flush: Lsn) -> Result<()> {
        self.confirmed = self.confirmed.max(flush);
        self.send_status().await
    }

    async fn send_status(&mut self) -> Result<()> {
        let update = StandbyStatusUpdate {
            write: self.received.max(self.confirmed),
            flush: self.confirmed,
            apply: self.confirmed,
            send_time: pg_now_micros(),
            reply_requested: false,
        };
        self.stream
            .send_status(&update)
            .await
            .context("sending a standby status update")?;
        self.last_status = Instant::now();
        Ok(())
    }

    /// Ends streaming (CopyDone) and returns the idle connection.
    pub async fn finish(self) -> Result<ReplicationClient> {
        self.stream.finish().await.context("ending the stream")
    }
}

/// Renders messages as stable one-line strings (no LSNs, xids, timestamps),
/// resolving relation OIDs through the RELATION messages seen so far, as a
/// subscriber must.
#[derive(Debug, Default)]
pub struct Renderer {
    relations: HashMap<u32, Relation>,
    types: HashMap<u32, String>,
}

impl Renderer {
    pub fn new() -> Renderer {
        Renderer::default()
    }

    /// The latest RELATION seen for `oid`.
    pub fn relation(&self, oid: u32) -> Option<&Relation> {
        self.relations.get(&oid)
    }

    /// Renders every message in order.
    pub fn render_all<'a>(&mut self, msgs: impl IntoIterator<Item = &'a Message>) -> Vec<String> {
        msgs.into_iter().map(|m| self.render(m)).collect()
    }

    /// Renders one message, remembering RELATION and TYPE messages for the
    /// ones after it.
    pub fn render(&mut self, msg: &Message) -> String {
        match msg {
            Message::Begin(_) => "BEGIN".into(),
            Message::Commit(_) => "COMMIT".into(),
            Message::Origin(o) => format!("ORIGIN {}", o.name),
            Message::Type(t) => {
                let name = qualified(&t.namespace, &t.name);
                self.types.insert(t.oid, name.clone());
                format!("TYPE {name}")
            }
            Message::Relation(r) => {
                let ident = match r.replica_identity {
                    mm_proto::pgoutput::ReplicaIdentity::Default => "default",
                    mm_proto::pgoutput::ReplicaIdentity::Nothing => "nothing",
                    mm_proto::pgoutput::ReplicaIdentity::Full => "full",
                    mm_proto::pgoutput::ReplicaIdentity::Index => "index",
                };
                let cols: Vec<String> = r
                    .columns
                    .iter()
                    .map(|c| {
                        let mut s = format!("{} {}", c.name, self.type_name(c.type_oid));
                        if c.type_modifier != -1 {
                            s.push_str(&format!("/{}", c.type_modifier));
                        }
                        if c.is_key {
                            s.push_str(" key");
                        }
                        s
                    })
                    .collect();
                self.relations.insert(r.oid, r.clone());
                format!(
                    "RELATION {} {ident} [{}]",
                    qualified(&r.namespace, &r.name),
                    cols.join(", ")
                )
            }
            Message::Insert(i) => {
                format!("INSERT {} {}", self.rel_name(i.relation_oid), tuple(&i.new))
            }
            Message::Update(u) => match &u.old {
                None => format!("UPDATE {} {}", self.rel_name(u.relation_oid), tuple(&u.new)),
                Some(old) => format!(
                    "UPDATE {} {} -> {}",
                    self.rel_name(u.relation_oid),
                    self.old_tuple(u.relation_oid, old),
                    tuple(&u.new)
                ),
            },
            Message::Delete(d) => format!(
                "DELETE {} {}",
                self.rel_name(d.relation_oid),
                self.old_tuple(d.relation_oid, &d.old)
            ),
            Message::Truncate(t) => {
                let mut s = "TRUNCATE".to_owned();
                if t.cascade {
                    s.push_str(" cascade");
                }
                if t.restart_identity {
                    s.push_str(" restart_identity");
                }
                let names: Vec<String> =
                    t.relation_oids.iter().map(|o| self.rel_name(*o)).collect();
                format!("{s} {}", names.join(", "))
            }
            Message::Message(m) => format!(
                "MESSAGE {} {} {}",
                if m.transactional {
                    "transactional"
                } else {
                    "non-transactional"
                },
                m.prefix,
                text(&m.content)
            ),
            Message::StreamStart(s) if s.first_segment => "STREAM START first".into(),
            Message::StreamStart(_) => "STREAM START".into(),
            Message::StreamStop => "STREAM STOP".into(),
            Message::StreamCommit(_) => "STREAM COMMIT".into(),
            Message::StreamAbort(_) => "STREAM ABORT".into(),
            Message::BeginPrepare(b) => format!("BEGIN PREPARE {}", b.gid),
            Message::Prepare(p) => format!("PREPARE {}", p.gid),
            Message::CommitPrepared(c) => format!("COMMIT PREPARED {}", c.gid),
            Message::RollbackPrepared(r) => format!("ROLLBACK PREPARED {}", r.gid),
            Message::StreamPrepare(p) => format!("STREAM PREPARE {}", p.gid),
        }
    }

    fn rel_name(&self, oid: u32) -> String {
        self.relations
            .get(&oid)
            .map_or_else(|| format!("<unknown relation {oid}>"), |r| r.name.clone())
    }

    fn type_name(&self, oid: u32) -> String {
        let builtin = match oid {
            16 => "bool",
            17 => "bytea",
            20 => "int8",
            21 => "int2",
            23 => "int4",
            25 => "text",
            1007 => "int4[]",
            1043 => "varchar",
            1184 => "timestamptz",
            1700 => "numeric",
            3802 => "jsonb",
            _ => {
                return self
                    .types
                    .get(&oid)
                    .cloned()
                    .unwrap_or_else(|| format!("oid{oid}"));
            }
        };
        builtin.to_owned()
    }

    /// 'K' tuples show only the identity columns, by name (the others were
    /// not sent); 'O' tuples show the whole old row.
    fn old_tuple(&self, rel_oid: u32, old: &OldTuple) -> String {
        match old {
            OldTuple::Full(t) => format!("O{}", tuple(t)),
            OldTuple::Key(k) => {
                let Some(rel) = self.relations.get(&rel_oid) else {
                    return format!("K<unknown relation {rel_oid}>");
                };
                match k.values(rel) {
                    Ok(values) => {
                        let keys: Vec<String> = rel
                            .columns
                            .iter()
                            .zip(values)
                            .filter_map(|(c, v)| match v {
                                KeyValue::Key(v) => Some(format!("{}={}", c.name, value(v))),
                                KeyValue::NotSent => None,
                            })
                            .collect();
                        format!("K({})", keys.join(", "))
                    }
                    Err(e) => format!("K<{e}>"),
                }
            }
        }
    }
}

fn qualified(namespace: &str, name: &str) -> String {
    if namespace.is_empty() {
        format!("pg_catalog.{name}")
    } else {
        format!("{namespace}.{name}")
    }
}

fn tuple(t: &TupleData) -> String {
    let cols: Vec<String> = t.columns.iter().map(value).collect();
    format!("({})", cols.join(", "))
}

/// NULL, TOAST (unchanged, not sent), a quoted text value, or b:hex.
pub fn value(v: &ColumnValue) -> String {
    match v {
        ColumnValue::Null => "NULL".into(),
        ColumnValue::UnchangedToast => "TOAST".into(),
        ColumnValue::Text(b) => text(b),
        ColumnValue::Binary(b) => {
            let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
            format!("b:{hex}")
        }
    }
}

/// A text value as an SQL literal (quotes doubled); long values shortened to
/// head, tail and length so a TOASTed value still fits on one line.
fn text(b: &Bytes) -> String {
    let s = String::from_utf8_lossy(b);
    let quoted = |s: &str| format!("'{}'", s.replace('\'', "''"));
    let chars: Vec<char> = s.chars().collect();
    if chars.len() <= 60 {
        quoted(&s)
    } else {
        let head: String = chars[..8].iter().collect();
        let tail: String = chars[chars.len() - 8..].iter().collect();
        format!("{}..{}[{} bytes]", quoted(&head), quoted(&tail), b.len())
    }
}

/// Runs `sql` in its own transaction on `client` and returns the
/// transaction's 32-bit xid (what pgoutput's BEGIN carries).
pub async fn run_txn(client: &tokio_postgres::Client, sql: &str) -> Result<u32> {
    client.batch_execute("BEGIN").await?;
    let run = async {
        client.batch_execute(sql).await?;
        let xid = current_xid(client).await?;
        client.batch_execute("COMMIT").await?;
        anyhow::Ok(xid)
    };
    match run.await {
        Ok(xid) => Ok(xid),
        Err(e) => {
            let _ = client.batch_execute("ROLLBACK").await;
            Err(e).with_context(|| format!("transaction {sql:?}"))
        }
    }
}

/// The 32-bit xid of the transaction open on `client` (assigning one).
pub async fn current_xid(client: &tokio_postgres::Client) -> Result<u32> {
    let row = client
        .query_one(
            "SELECT (pg_current_xact_id()::text::bigint % 4294967296)::bigint",
            &[],
        )
        .await?;
    let xid: i64 = row.try_get(0)?;
    u32::try_from(xid).context("xid out of range")
}

/// The slot's confirmed_flush_lsn as the server reports it.
pub async fn confirmed_flush(client: &tokio_postgres::Client, slot: &str) -> Result<Lsn> {
    let row = client
        .query_one(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    let text: Option<String> = row.try_get(0)?;
    let text = text.with_context(|| format!("slot {slot} has no confirmed_flush_lsn"))?;
    text.parse()
        .with_context(|| format!("confirmed_flush_lsn {text:?}"))
}
