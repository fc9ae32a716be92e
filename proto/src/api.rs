//! Types shared by the agent's HTTP API and `mmctl` (JSON over HTTP).
//!
//! They live here, not in the agent, so that the CLI, the tests and external
//! tools decode exactly what the agent encodes.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::Lsn;

/// One replication stream into a node: changes committed on `from`, applied on `to`.
/// Reported by the agent of `to` (the subscriber side owns the stream task).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamStatus {
    pub from: String,
    pub to: String,
    pub state: StreamState,
    /// The error that stopped the stream most recently (names peer, relation and LSN).
    pub last_error: Option<String>,
    /// Highest publisher WAL position received (XLogData or keepalive).
    pub received_lsn: Option<Lsn>,
    /// End LSN of the last remote transaction committed locally (the origin's progress).
    pub applied_lsn: Option<Lsn>,
    /// Highest publisher WAL position below which every transaction of `from`
    /// has been applied here: what `wait-sync` compares against.
    pub processed_lsn: Option<Lsn>,
    /// Publisher WAL bytes not yet applied (publisher's current WAL end minus applied).
    pub lag_bytes: Option<u64>,
    /// Seconds between the newest applied remote commit and now, 0 when caught up.
    pub lag_seconds: Option<f64>,
    pub applied_txns: u64,
    pub applied_rows: u64,
    /// Conflicts detected on this stream, by PostgreSQL 18 conflict type name.
    pub conflicts: BTreeMap<String, u64>,
    /// Cross-origin changes applied without a conflict because the publisher
    /// had already seen the local version (its watermark covered it): routine
    /// traffic, counted but never logged.
    #[serde(default)]
    pub routine: u64,
    /// Restarts after errors since the agent started.
    pub restarts: u64,
    /// Bytes of in-progress transactions received (streamed and spooled)
    /// before their commit: evidence that large transactions stream.
    #[serde(default)]
    pub streamed_bytes: u64,
    /// Transactions sent whole whose changes were applied while they still
    /// arrived, before their COMMIT (large ones): evidence that receiving
    /// and applying overlap.
    #[serde(default)]
    pub early_txns: u64,
    /// Transactions whose fast-path attempt met a conflict and was rolled
    /// back before the careful path applied them: what conflicts cost. Those
    /// on a key that just conflicted skip the attempt (apply/hot.rs).
    #[serde(default)]
    pub conflict_rollbacks: u64,
    /// Conflicts on keys that just conflicted settled inside the fast
    /// path's own statement, pipelined, with neither a rolled-back attempt
    /// nor the careful path (also counted in `conflicts`).
    #[serde(default)]
    pub conflicts_in_place: u64,
    /// Whether the last error will go away by itself (a connection, a
    /// restart) or needs an operator (a transaction that cannot be applied).
    #[serde(default)]
    pub error_kind: Option<ErrorKind>,
    /// The transaction the stream is stopped at (a definite error): its
    /// commit LSN, as `mmctl skip --lsn` takes it, and commit timestamp.
    #[serde(default)]
    pub stuck_lsn: Option<Lsn>,
    #[serde(default)]
    pub stuck_commit_ts: Option<chrono::DateTime<chrono::Utc>>,
    /// The publisher's newest WAL position this node knows of (lag probe or
    /// stream): `lag_bytes` is measured against it.
    #[serde(default)]
    pub publisher_lsn: Option<Lsn>,
}

/// See `StreamStatus::error_kind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// Retried until it passes (publisher or local node unreachable or
    /// restarting, a deadlock): nothing for an operator to do but wait.
    Transient,
    /// The same transaction fails every time: the stream cannot move until
    /// the data or schema is fixed or the transaction is skipped.
    Definite,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamState {
    /// Connecting, creating the slot or waiting for the first message.
    Starting,
    Streaming,
    /// Paused by `mmctl pause`: the publisher's slot keeps the changes.
    Paused,
    /// Stopped by an error; retried with backoff.
    Error,
    Stopped,
}

// ---------------------------------------------------------------------------
// Control plane: cluster membership, admin API requests and responses.
// ---------------------------------------------------------------------------

/// Lifecycle of a cluster member as recorded in Raft. Each add-node step that
/// completes is recorded by moving the node forward, so an interrupted join
/// resumes from the recorded state instead of starting over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeState {
    /// In Raft's state machine, a learner; slots and streams are being set up.
    Joining,
    /// Receiving its initial data copy and catching up from every peer.
    Syncing,
    /// A voter that accepts writes and streams to and from every other active node.
    Active,
    /// Being removed: streams and slots are torn down before it leaves Raft.
    Parting,
}

impl NodeState {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Joining => "joining",
            NodeState::Syncing => "syncing",
            NodeState::Active => "active",
            NodeState::Parting => "parting",
        }
    }
}

impl std::fmt::Display for NodeState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One cluster member as the Raft state machine knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// Random, never reused: a wiped node that comes back gets a new identity.
    pub id: u64,
    pub name: String,
    /// The agent's advertised HTTP API (Raft RPC and admin).
    pub api_url: String,
    /// How peers reach this node's PostgreSQL. Holds no password (config validation
    /// refuses one): passwords come from each agent's own password file.
    pub peer_dsn: String,
    pub state: NodeState,
}

/// `GET /v1/info`: who an agent is, asked before it is added to a cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InfoResponse {
    pub name: String,
    pub node_id: u64,
    pub api_url: String,
    pub peer_dsn: String,
    /// True once the agent belongs to a Raft group (its own or one it joined).
    pub raft_initialized: bool,
}

/// `POST /v1/init` result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InitResponse {
    pub name: String,
    pub node_id: u64,
}

/// `POST /v1/nodes`: add the agent at `url`, which must call itself `name`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddNodeRequest {
    pub name: String,
    pub url: String,
    /// The node to copy the data from; default: the least lagged active node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
}

/// `GET /v1/sync` on a node being added with data: its initial copy.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SyncReport {
    /// `idle` (nothing to copy), `starting`, `cleanup`, `waiting` (for the
    /// peers' positions), `snapshot`, `schema`, `copying`, `done`,
    /// `failed` (retried: see `error`) or `refused` (the tables do not fit;
    /// looked at again every few seconds).
    pub phase: String,
    pub source: Option<String>,
    /// What it is doing now, in words.
    pub detail: String,
    pub tables_total: u64,
    pub tables_done: u64,
    /// Rows and bytes copied so far (counted as they arrive).
    pub rows: u64,
    pub bytes: u64,
    /// The source's estimate of its rows (`pg_class.reltuples`), for a
    /// rate and an ETA; 0 when it has none (never analyzed).
    #[serde(default)]
    pub rows_estimate: u64,
    pub elapsed_secs: f64,
    /// The last failure of an attempt (the copy starts again after it).
    pub error: Option<String>,
    pub attempts: u64,
}

/// `POST /v1/pause` and `POST /v1/resume`: the stream of `from`'s changes into `to`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PairRequest {
    pub from: String,
    pub to: String,
}

/// `POST /v1/pause` and `POST /v1/resume` result: the pair's state after the call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PauseResponse {
    pub from: String,
    pub to: String,
    pub paused: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaderInfo {
    pub id: u64,
    /// None while the leader is a Raft member the state machine does not list
    /// (e.g. a just-initialized node before its own AddNode is applied).
    pub name: Option<String>,
    pub url: String,
}

/// Raft membership as this node currently sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Members {
    pub voters: Vec<u64>,
    pub learners: Vec<u64>,
}

/// `GET /v1/status`: one node's view of the cluster plus the streams INTO it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusResponse {
    pub node: String,
    pub node_id: u64,
    pub leader: Option<LeaderInfo>,
    pub term: u64,
    pub last_applied_index: u64,
    pub members: Members,
    pub nodes: Vec<NodeInfo>,
    /// (from, to) node names whose stream is paused.
    pub paused: Vec<(String, String)>,
    pub streams: Vec<StreamStatus>,
    /// Rows in this node's `mm.tombstones` at the last count, None until the
    /// data plane has counted them.
    #[serde(default)]
    pub tombstones: Option<u64>,
    /// The cluster's global sequences (from Raft: the same on every node).
    #[serde(default)]
    pub sequences: Vec<SequenceStatus>,
}

/// A global sequence in `mmctl status`: how much is left to hand out, and
/// each node's newest chunks (the one in use and its reserve).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SequenceStatus {
    pub name: String,
    pub chunk: i64,
    pub max: i64,
    /// Values not handed out to any node yet.
    pub left: i64,
    /// Fewer than eight chunks left (or none): time to act, long before
    /// inserts would fail.
    pub running_out: bool,
    pub exhausted: bool,
    pub ranges: Vec<SequenceRangeInfo>,
}

/// `POST /v1/pending` on the subscriber: is a transaction of `from`
/// committed below `upto` still waiting in `from`'s slot for this node? For
/// streams that do not run (paused): `wait-sync` asks it so that a paused
/// stream counts as behind only when something really waits, not when the
/// publisher's WAL merely moved (watermarks, changes from other nodes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PendingRequest {
    pub from: String,
    pub upto: Lsn,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingResponse {
    /// The first waiting transaction's commit timestamp; None: none waits.
    pub first_commit_ts: Option<chrono::DateTime<chrono::Utc>>,
}

/// `GET /v1/wal-lsn`: the local PostgreSQL's current WAL insert position,
/// taken after the node sent the compensating deletes that were due.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WalLsnResponse {
    pub lsn: Lsn,
    /// Compensating deletes this node ever recorded: `wait-sync` is done
    /// only when a round added none anywhere.
    #[serde(default)]
    pub compensations: u64,
    /// Recorded ones not sent yet (waiting for the clock to pass them).
    #[serde(default)]
    pub compensations_waiting: u64,
}

/// `POST /v1/skip`: on the addressed node, skip the transaction of node
/// `from` that commits at `lsn` (its commit LSN, as shown in the stream's
/// last error). `lsn` is text so a malformed one gets a precise error.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SkipRequest {
    pub from: String,
    pub lsn: String,
}

/// `POST /v1/skip` result: the request is stored in the node's
/// `mm.skip_requests`; the stream from `from` applies it when it next starts
/// (it was told to restart now rather than after its backoff).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkipResponse {
    /// The node that will skip the transaction (the addressed agent's node).
    pub node: String,
    pub from: String,
    pub lsn: Lsn,
    /// True when the same request was already pending (nothing changed).
    pub already_requested: bool,
}

/// One row of a node's `mm.conflict_log` (SPEC §5). Timestamps are UTC,
/// RFC 3339 with microseconds (`2026-01-02T03:04:05.123456Z`), so they sort
/// as text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConflictRecord {
    /// The node whose conflict log holds the row (where it was resolved).
    pub node: String,
    pub id: i64,
    pub at: String,
    /// `schema.table`; empty for a skipped transaction.
    pub relation: String,
    pub conflict_type: String,
    pub key: Option<serde_json::Value>,
    pub local_origin: Option<String>,
    pub local_commit_ts: Option<String>,
    pub remote_origin: Option<String>,
    pub remote_commit_ts: Option<String>,
    pub remote_lsn: Option<Lsn>,
    pub resolution: String,
    pub local_tuple: Option<serde_json::Value>,
    pub remote_tuple: Option<serde_json::Value>,
}

/// `GET /v1/conflicts?limit=K`: the newest `limit` rows of this node's own
/// conflict log, newest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConflictsResponse {
    pub node: String,
    pub conflicts: Vec<ConflictRecord>,
}

/// A node whose conflict log could not be read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeError {
    pub node: String,
    pub api_url: String,
    pub error: String,
}

/// `GET /v1/cluster/conflicts?limit=K`: every member's conflict log merged,
/// newest first (by `at`), at most `limit` rows. Nodes that did not answer
/// are listed in `errors`; the others' rows are still returned.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterConflictsResponse {
    pub limit: u32,
    /// Nodes whose logs were read.
    pub nodes: Vec<String>,
    pub conflicts: Vec<ConflictRecord>,
    pub errors: Vec<NodeError>,
}

/// Body of every non-2xx answer of the agent's API.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
}

/// `POST /v1/sequence-local` on every node (`mmctl sequence add` asks each
/// one before the sequence becomes global): what this node's copy of the
/// sequence has handed out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SequenceLocalRequest {
    /// Schema-qualified.
    pub name: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SequenceLocalResponse {
    /// The largest value in use here: the sequence's last value, or the
    /// owning column's largest value (rows may have come from elsewhere).
    pub used_max: Option<i64>,
    pub min_value: i64,
    pub max_value: i64,
    pub increment: i64,
}

/// `POST /v1/sequences`: make a sequence cluster-global, allocating from
/// `start` (above every node's `used_max`) up to `max`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SequenceAddRequest {
    pub name: String,
    pub chunk: i64,
    pub start: i64,
    pub max: i64,
}

/// `POST /v1/sequences/allocate`: the next chunk for `node` (agents refill
/// through it; forwarded to the Raft leader).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SequenceAllocateRequest {
    pub sequence: String,
    pub node: String,
    /// Chunks of this node the requester knew of (a retry takes none).
    pub known: usize,
}

/// One chunk of a global sequence: values `start..=end` for `node`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SequenceRangeInfo {
    pub node: String,
    pub start: i64,
    pub end: i64,
}

/// `GET /v1/sequences`: the allocator's view (Raft) and this node's use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SequencesResponse {
    pub node: String,
    pub sequences: Vec<SequenceInfo>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SequenceInfo {
    pub name: String,
    pub chunk: i64,
    /// First value not handed out yet.
    pub next: i64,
    pub max: i64,
    pub exhausted: bool,
    pub ranges: Vec<SequenceRangeInfo>,
    /// This node's local sequence: the chunk it draws from and its last
    /// value; None until the agent switched it into one of its chunks.
    pub current: Option<SequenceRangeInfo>,
    pub last_value: Option<i64>,
}

/// `POST /v1/nodes/remove` (forwarded to the Raft leader).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoveNodeRequest {
    pub name: String,
}

/// `GET /v1/slots`: the agent's slots and origins on this node's
/// PostgreSQL (`mmctl remove-node` waits until none is left for the
/// removed node).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotsResponse {
    pub node: String,
    pub slots: Vec<String>,
    pub origins: Vec<String>,
}
