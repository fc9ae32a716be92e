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
    /// Restarts after errors since the agent started.
    pub restarts: u64,
    /// Bytes of in-progress transactions received (streamed and spooled)
    /// before their commit: evidence that large transactions stream.
    #[serde(default)]
    pub streamed_bytes: u64,
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
}

/// `GET /v1/wal-lsn`: the local PostgreSQL's current WAL insert position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WalLsnResponse {
    pub lsn: Lsn,
}

/// Body of every non-2xx answer of the agent's API.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
}
