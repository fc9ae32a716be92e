//! One stream per peer: the peer's local commits, read from its slot over
//! logical replication, applied here in the peer's commit order.
//!
//! Invariant (no loops): `origin 'none'` makes the publisher send only
//! transactions committed locally on it, never ones its agent applied from a
//! third node.
//! Invariant (durability-gated feedback): the flush position reported to the
//! publisher is the highest applied position whose local commit is flushed
//! (`Applier::durable_progress`); the received-but-idle position is reported
//! only when every applied transaction is already durable. The publisher
//! therefore never discards a change we could still lose.

mod early;
pub mod names;
mod receive;
mod spool;
mod supervisor;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use mm_proto::Lsn;
use mm_proto::api::{ErrorKind, StreamState};
use mm_proto::client::{ReplicationClient, ReplicationConfig, SnapshotAction};
use mm_proto::pgoutput::{Begin, Message, StreamTracker};
use mm_proto::walsender::{ServerMessage, StandbyStatusUpdate, pg_now_micros};
use tracing::{Instrument, debug, info, info_span};

use crate::apply::{Applier, ApplyContext, ApplyFailure, Done, TxnBody, TxnMeta};
use crate::status::StatusRegistry;
use crate::watermark::Announcement;
use spool::Spool;

pub use supervisor::{StreamHandle, spawn_stream};

/// How often we report progress (and ask for a keepalive, whose position lets
/// an idle stream's processed position advance for `wait-sync`).
const FEEDBACK_INTERVAL: Duration = Duration::from_millis(300);

/// What a stream needs to know about the local node and the agent.
#[derive(Clone)]
pub struct LocalNode {
    pub name: String,
    pub dsn: String,
    pub password: Option<String>,
    pub data_dir: PathBuf,
    pub synchronous_commit: String,
    /// Apply sessions per stream (`replication.apply_lanes`, `apply/lanes.rs`).
    pub apply_lanes: usize,
    /// Remote transactions a stream that is behind may apply as one local
    /// transaction (`replication.group_transactions`, `apply/group.rs`).
    pub group_transactions: usize,
    pub status: Arc<StatusRegistry>,
    pub resolvers: Arc<crate::conflict::TableResolvers>,
    pub watermarks: Arc<crate::watermark::Watermarks>,
    /// Between fast-path and careful transactions of all streams
    /// (`apply/gate.rs`).
    pub gate: crate::apply::Gate,
    /// The cluster token, for asking peers whether this node was removed.
    pub token: Arc<str>,
}

/// The publisher side of a stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    pub name: String,
    pub peer_dsn: String,
}

/// Why a stream stopped. Always names the peer and, when known, relation and LSN.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("stream from {peer}: cannot apply transaction {xid} (commit LSN {lsn}): {failure}")]
    Apply {
        peer: String,
        xid: u32,
        lsn: Lsn,
        failure: Box<ApplyFailure>,
    },
    #[error("stream from {peer}: local node: {failure}")]
    Local {
        peer: String,
        failure: Box<ApplyFailure>,
    },
    #[error("stream from {peer}: replication connection: {source}")]
    Replication {
        peer: String,
        #[source]
        source: mm_proto::client::ClientError,
    },
    #[error("stream from {peer}: malformed message at LSN {lsn}: {message}")]
    Protocol {
        peer: String,
        lsn: Lsn,
        message: String,
    },
    #[error("stream from {peer}: spool: {source}")]
    Spool {
        peer: String,
        #[source]
        source: std::io::Error,
    },
    #[error("stream from {peer}: the publisher closed the stream")]
    Closed { peer: String },
}

impl StreamError {
    /// Transient errors pass by themselves (the stream retries); definite
    /// ones repeat on the same transaction until an operator acts. Decides
    /// whether `wait-sync` keeps waiting or fails at once.
    pub fn kind(&self) -> ErrorKind {
        match self {
            StreamError::Apply { failure, .. } => failure_kind(failure),
            // Opening the apply session or reading local positions: the local
            // node is down or restarting, unless PostgreSQL named a definite
            // problem.
            StreamError::Local { failure, .. } if failure.sqlstate.is_none() => {
                ErrorKind::Transient
            }
            StreamError::Local { failure, .. } => failure_kind(failure),
            StreamError::Protocol { .. } => ErrorKind::Definite,
            StreamError::Replication { .. }
            | StreamError::Spool { .. }
            | StreamError::Closed { .. } => ErrorKind::Transient,
        }
    }

    /// The remote transaction the stream is stopped at (commit LSN and
    /// timestamp), when a definite error names one.
    pub fn stuck_at(&self) -> Option<(Lsn, Option<chrono::DateTime<chrono::Utc>>)> {
        match self {
            StreamError::Apply { lsn, failure, .. } if self.kind() == ErrorKind::Definite => {
                Some((*lsn, failure.txn.and_then(|t| t.commit_ts.to_datetime())))
            }
            _ => None,
        }
    }
}

/// SQLSTATE classes that pass by themselves: connection exceptions (08),
/// transaction rollbacks such as deadlocks (40), insufficient resources
/// (53), operator intervention such as a shutdown (57), system errors (58)
/// and lock timeouts (55P03). No SQLSTATE and "local PostgreSQL:" means the
/// connection itself failed.
fn failure_kind(f: &ApplyFailure) -> ErrorKind {
    match f.sqlstate.as_deref() {
        Some(code)
            if ["08", "40", "53", "57", "58"]
                .iter()
                .any(|c| code.starts_with(c)) =>
        {
            ErrorKind::Transient
        }
        // Lock timeout; MM002: a row an update needs may still arrive
        // from its origin through another node (apply/careful/); MM003:
        // the progress guard (a transaction queued on top of one that did
        // not commit): the restarted stream resumes from the durable
        // progress, so it passes by itself.
        Some("55P03" | "MM002" | "MM003") => ErrorKind::Transient,
        None if f.message.starts_with("local PostgreSQL:") => ErrorKind::Transient,
        _ => ErrorKind::Definite,
    }
}

/// Per-stream progress, mirrored into the status registry.
struct Progress {
    /// Highest publisher WAL position seen (data or keepalive).
    received: Lsn,
    /// End LSN of the last transaction committed locally.
    applied: Lsn,
    /// Everything of the publisher's below this is applied here.
    processed: Lsn,
    /// End of the last transaction handed to the applier.
    last_queued: Lsn,
    /// The publisher's latest watermark, effective for tombstone purging
    /// once everything queued before it has committed (see `watermark`).
    pending_watermark: Option<(Lsn, Announcement)>,
}

/// Connects and streams until an error or cancellation (the caller drops us).
pub async fn run(local: &LocalNode, peer: &Peer) -> Result<(), StreamError> {
    let span = info_span!("stream", from = %peer.name, to = %local.name);
    run_inner(local, peer).instrument(span).await
}

async fn run_inner(local: &LocalNode, peer: &Peer) -> Result<(), StreamError> {
    let pname = peer.name.clone();
    let local_err = |failure| StreamError::Local {
        peer: pname.clone(),
        failure: Box::new(failure),
    };
    let repl_err = |source| StreamError::Replication {
        peer: pname.clone(),
        source,
    };
    let status = &local.status;

    let origin = names::origin_name(&peer.name);
    let (applier, start) = Applier::open(
        &local.dsn,
        local.password.as_deref(),
        &origin,
        &local.synchronous_commit,
        ApplyContext {
            local_node: local.name.clone(),
            peer: peer.name.clone(),
            resolvers: Arc::clone(&local.resolvers),
            peer_dsn: peer.peer_dsn.clone(),
            peer_password: local.password.clone(),
            applied: Arc::clone(&local.watermarks),
            gate: local.gate.clone(),
            group_transactions: local.group_transactions,
        },
        local.apply_lanes,
    )
    .await
    .map_err(local_err)?;

    let (txns, conflicts) = applier.stored_counters().await.map_err(local_err)?;
    status.update(&peer.name, |s| {
        s.applied_txns = txns;
        s.conflicts = conflicts;
    });

    let mut cfg = ReplicationConfig::from_dsn(&peer.peer_dsn)
        .map_err(repl_err)?
        .with_portable_text_settings()
        .with_application_name(names::application_name(&peer.name, &local.name))
        .with_connect_timeout(Duration::from_secs(10));
    if let Some(pw) = &local.password {
        cfg = cfg.with_password(pw.clone());
    }
    let mut client = ReplicationClient::connect(&cfg).await.map_err(repl_err)?;
    // Where the publisher's WAL is now: how far behind this stream starts,
    // before the lag probe's first sample says so (`Receiver::behind_to`).
    let publisher_at_start = client.identify_system().await.map_err(repl_err)?.xlogpos;
    let slot = names::slot_name(&peer.name, &local.name);
    ensure_slot(&mut client, &slot).await.map_err(repl_err)?;

    let options = [
        ("proto_version", "4"),
        ("publication_names", "\"mm\""),
        ("origin", "none"),
        ("streaming", "on"),
        ("messages", "true"),
    ];
    let mut stream = client
        .start_logical_replication(&slot, start, &options)
        .await
        .map_err(repl_err)?;
    info!(%slot, %start, "streaming");

    let spool = Spool::open(&local.data_dir.join("spool").join(&peer.name)).map_err(|source| {
        StreamError::Spool {
            peer: pname.clone(),
            source,
        }
    })?;
    let tracker = StreamTracker::new(4, false);
    let progress = Progress {
        received: start,
        applied: start,
        processed: start,
        last_queued: start,
        pending_watermark: None,
    };
    local.watermarks.forget(&peer.name);
    status.update(&peer.name, |s| {
        s.state = StreamState::Streaming;
        s.applied_lsn = Some(start);
        s.last_error = None;
    });

    let mut rx = receive::Receiver {
        local,
        peer: pname.clone(),
        applier,
        spool,
        tracker,
        progress,
        current: None,
        stream_xid: None,
        streamed_early: None,
        deferred_announcement: None,
        publisher_at_start,
    };
    let mut ticker = tokio::time::interval(FEEDBACK_INTERVAL);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

    loop {
        rx.before_next().await?;
        // A group of transactions is held while the next message is already
        // here or the apply session is still busy with what was sent
        // (`apply/group.rs`); before the session would go idle, it is sent.
        let holding = rx.applier.group_open();
        // A group held across a long run of ready messages (a large
        // transaction's) must not starve feedback and status; the tick
        // sends the group (`durable_progress`).
        if holding && futures_util::FutureExt::now_or_never(ticker.tick()).is_some() {
            rx.on_tick(&mut stream).await?;
            continue;
        }
        let ready = match holding && rx.applier.wants_more() {
            true => futures_util::FutureExt::now_or_never(stream.next()),
            false => None,
        };
        let msg = match ready {
            Some(m) => m,
            // Nothing to read and the session idle, working off a backlog:
            // the next message is on its way (`group_may_wait`).
            None if holding && rx.applier.sent_in_flight() == 0 && rx.applier.group_may_wait() => {
                match tokio::time::timeout(GROUP_WAIT, stream.next()).await {
                    Ok(m) => m,
                    Err(_) => {
                        rx.applier
                            .close_group()
                            .await
                            .map_err(|f| apply_err(&pname, None, f))?;
                        continue;
                    }
                }
            }
            // Nothing to read and the session idle: the group goes now.
            None if holding && rx.applier.sent_in_flight() == 0 => {
                rx.applier
                    .close_group()
                    .await
                    .map_err(|f| apply_err(&pname, None, f))?;
                continue;
            }
            None => tokio::select! {
                // In this order: feedback is never starved by a busy stream, and
                // replies are waited for only when the stream has nothing to
                // read (or the pipeline is full). Waiting for replies is what
                // sends the pipelined session's Sync (`apply/pipeline.rs`), so
                // batches grow as long as messages keep coming.
                biased;
                _ = ticker.tick() => {
                    rx.on_tick(&mut stream).await?;
                    continue;
                }
                // Never disabled with nothing in flight: the branch below then
                // has replies to wait for.
                m = stream.next(), if rx.applier.wants_more() => m,
                // Replies of pipelined transactions, consumed as they come so
                // status and wait-sync see commits promptly. A group held
                // meanwhile stays held.
                r = rx.applier.settle_next(), if rx.applier.in_flight() > 0 => {
                    match r {
                        Err(f) => rx.applier.resolve_failure(f).await,
                        r => r,
                    }
                    .map_err(|f| apply_err(&pname, None, f))?;
                    finished(&mut rx.applier, local, &pname, &mut rx.progress);
                    continue;
                }
            },
        };
        let msg = match msg {
            None => return Err(StreamError::Closed { peer: pname }),
            Some(Err(e)) => return Err(repl_err(e)),
            Some(Ok(m)) => m,
        };
        match msg {
            ServerMessage::PrimaryKeepalive {
                wal_end,
                send_time: _,
                reply_requested,
            } => {
                rx.on_keepalive(&mut stream, wal_end, reply_requested)
                    .await?
            }
            ServerMessage::XLogData {
                wal_start,
                wal_end,
                data,
                ..
            } => rx.on_data(wal_start, wal_end, data).await?,
        }
    }
}

/// How long a group held in a backlog waits for the next message before
/// it is sent (`Applier::group_may_wait`): a few transactions' worth of the
/// walsender's time, far below any lag a backlog already has.
const GROUP_WAIT: Duration = Duration::from_millis(2);

/// A transaction sent whole (after its commit on the publisher) is kept
/// in memory up to this many bytes of messages, then in the spool: it must
/// stay available until it commits here (see `spool.rs`), and decoded
/// messages take many times their wire size.
const SPILL_AT: usize = 1 << 20;

/// The ordinary (non-streamed) transaction being received.
struct OpenTxn {
    begin: Begin,
    msgs: Vec<Message>,
    /// The wire bytes of `msgs` (shared with them), written to the spool
    /// when the transaction outgrows `SPILL_AT`.
    raws: Vec<Bytes>,
    bytes: usize,
    /// Its messages are in the spool under its xid, not in `msgs`.
    spilled: bool,
    /// Applied while it arrives (`apply/early.rs`): the messages received
    /// since the last part was queued.
    early: Option<Vec<Message>>,
    /// The applier declined to begin it early, or gave it up: it waits
    /// for its COMMIT.
    early_declined: bool,
    /// When its last message arrived while applied early.
    last_at: Instant,
}

impl OpenTxn {
    fn new(begin: Begin) -> Self {
        OpenTxn {
            begin,
            msgs: Vec::new(),
            raws: Vec::new(),
            bytes: 0,
            spilled: false,
            early: None,
            early_declined: false,
            last_at: Instant::now(),
        }
    }

    fn push(&mut self, m: Message, raw: Bytes, spool: &mut Spool) -> std::io::Result<()> {
        let xid = self.begin.xid;
        if let Some(part) = self.early.as_mut() {
            self.last_at = Instant::now();
            // Values are shared `Bytes`: the clone copies no row data.
            part.push(m.clone());
        }
        if self.spilled {
            return spool.append_committed(xid, &raw);
        }
        self.bytes += raw.len();
        self.msgs.push(m);
        self.raws.push(raw);
        if self.bytes > SPILL_AT {
            for r in self.raws.drain(..) {
                spool.append_committed(xid, &r)?;
            }
            self.msgs = Vec::new();
            self.spilled = true;
        }
        Ok(())
    }
}

/// The publisher's watermark, effective from the next transaction on.
async fn announce(
    applier: &mut Applier,
    local: &LocalNode,
    peer: &str,
    progress: &mut Progress,
    a: Announcement,
) -> Result<(), StreamError> {
    // Settles what is queued first: a failure there names its transaction.
    applier
        .set_watermarks(a.applied.clone())
        .await
        .map_err(|f| failure_err(peer, f))?;
    progress.pending_watermark = Some((progress.last_queued, a));
    finished(applier, local, peer, progress);
    Ok(())
}

/// The stream error for a failed transaction: the failure names the
/// transaction when pipelining had already moved past it.
fn apply_err(peer: &str, queued: Option<&TxnMeta>, failure: ApplyFailure) -> StreamError {
    let txn = failure.txn.or(queued.copied());
    StreamError::Apply {
        peer: peer.to_owned(),
        xid: txn.map_or(0, |t| t.xid),
        lsn: txn.map_or(Lsn::INVALID, |t| t.commit_lsn),
        failure: Box::new(failure),
    }
}

/// A failure met while waiting for replies: an apply failure when it names
/// its transaction, a local one otherwise.
fn failure_err(peer: &str, failure: ApplyFailure) -> StreamError {
    match failure.txn {
        Some(_) => apply_err(peer, None, failure),
        None => StreamError::Local {
            peer: peer.to_owned(),
            failure: Box::new(failure),
        },
    }
}

async fn apply_one(
    applier: &mut Applier,
    peer: &str,
    meta: &TxnMeta,
    src: TxnBody,
) -> Result<(), StreamError> {
    let span = tracing::debug_span!("txn", xid = meta.xid, lsn = %meta.commit_lsn);
    debug!(xid = meta.xid, commit_lsn = %meta.commit_lsn, end_lsn = %meta.end_lsn, "applying");
    applier
        .apply(meta, src)
        .instrument(span)
        .await
        .map_err(|f| apply_err(peer, Some(meta), f))
}

/// Accounts for every transaction whose local commit has been confirmed.
fn finished(applier: &mut Applier, local: &LocalNode, peer: &str, progress: &mut Progress) {
    for done in applier.take_done() {
        committed(&local.status, peer, progress, &done);
        if let Some(ts) = done.meta.commit_ts.to_datetime() {
            local.watermarks.applied(peer, ts);
        }
    }
    let routine = applier.take_routine();
    if routine > 0 {
        local.status.update(peer, |s| s.routine += routine);
    }
    if progress
        .pending_watermark
        .as_ref()
        .is_some_and(|(lsn, _)| progress.applied >= *lsn)
        && let Some((_, a)) = progress.pending_watermark.take()
    {
        // Everything before the announcement is applied here, so is every
        // commit the publisher made before it was written.
        if let Some(at) = a.at {
            local
                .watermarks
                .applied(peer, at - crate::watermark::HEARTBEAT_MARGIN);
        }
        local.watermarks.set_effective(peer, a.applied);
    }
}

fn committed(status: &StatusRegistry, peer: &str, progress: &mut Progress, done: &Done) {
    let meta = &done.meta;
    progress.applied = progress.applied.max(meta.end_lsn);
    progress.processed = progress.processed.max(meta.end_lsn);
    status.update(peer, |s| {
        s.applied_txns += 1;
        s.applied_rows += done.rows;
        s.applied_lsn = Some(progress.applied);
        s.processed_lsn = Some(progress.processed);
        s.received_lsn = Some(progress.received);
        // Moving again: whatever stopped it is over.
        s.stuck_lsn = None;
        s.stuck_commit_ts = None;
        s.routine += done.routine;
        s.conflict_rollbacks += u64::from(done.rolled_back);
        s.conflicts_in_place += done.in_place;
        for (ty, _) in &done.conflicts {
            *s.conflicts.entry((*ty).to_owned()).or_default() += 1;
        }
    });
    debug!(rows = done.rows, end = %meta.end_lsn, "applied");
}

/// Positions only: lag is measured by `lag.rs`, in every state.
fn publish(status: &StatusRegistry, peer: &str, p: &Progress) {
    status.update(peer, |s| {
        s.state = StreamState::Streaming;
        s.received_lsn = Some(p.received);
        s.processed_lsn = Some(p.processed);
        s.applied_lsn = Some(p.applied);
    });
}

/// Sends a standby status update. See the module invariant.
async fn send_feedback(
    applier: &mut Applier,
    stream: &mut mm_proto::client::LogicalReplicationStream,
    p: &mut Progress,
    idle: bool,
    reply_requested: bool,
    peer: &str,
) -> Result<(), StreamError> {
    let peer = peer.to_owned();
    // Waiting for replies may surface a failed (or conflicting and then
    // unresolvable) transaction: name it like any apply failure.
    let durable = applier
        .durable_progress()
        .await
        .map_err(|failure| failure_err(&peer, failure))?;
    let flush = if idle && durable >= p.applied {
        durable.max(p.processed)
    } else {
        durable
    };
    let update = StandbyStatusUpdate {
        write: p.received.max(flush),
        flush,
        apply: flush,
        send_time: pg_now_micros(),
        reply_requested,
    };
    stream
        .send_status(&update)
        .await
        .map_err(|source| StreamError::Replication { peer, source })
}

/// Creates the slot on the publisher unless it exists. The subscriber owns it:
/// it is `<from>`'s WAL kept for us.
pub(crate) async fn ensure_slot(
    client: &mut ReplicationClient,
    slot: &str,
) -> Result<(), mm_proto::client::ClientError> {
    // `slot` is built by names::slot_name from [a-z0-9_] only; still quote it.
    let rows = client
        .simple_query(&format!(
            "SELECT 1 FROM pg_catalog.pg_replication_slots WHERE slot_name = '{}'",
            slot.replace('\'', "''")
        ))
        .await?;
    if rows.is_empty() {
        let created = client
            .create_logical_slot(slot, "pgoutput", SnapshotAction::NoExport, false)
            .await?;
        info!(slot, consistent_point = %created.consistent_point, "created replication slot");
    }
    Ok(())
}
