//! The control plane's Raft group (openraft 0.9, storage-v2, redb).
//!
//! openraft's types stay inside this module: the rest of the agent uses
//! `RaftNode`, `ClusterState` and the request/response enums, so moving to
//! openraft 0.10 touches only these files.
//!
//! Node ids: every agent generates a random id at its first start and keeps it
//! in `data_dir/node_id`, so it can run its Raft instance (and answer RPCs)
//! before it is a member; the state machine refuses ids of removed nodes.

mod log_store;
mod network;
mod state_machine;
#[cfg(test)]
mod store_tests;
pub mod types;

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::Duration;

use mm_proto::api::{Members, NodeInfo};
use openraft::error::{ClientWriteError, InitializeError};
use openraft::{BasicNode, ChangeMembers, Config, Raft, ServerState, SnapshotPolicy};
use tokio::sync::watch;

pub use network::{PATH_APPEND, PATH_SNAPSHOT, PATH_VOTE, RpcKind, RpcServeError};
pub use types::{ClusterRequest, ClusterResponse, ClusterState, is_valid_node_name};

use self::log_store::{LogStore, StoreError, open_db};
use self::network::NetworkFactory;
use self::state_machine::StateMachine;
use self::types::TypeConfig;

/// File in data_dir holding this agent's Raft node id (decimal).
pub const NODE_ID_FILE: &str = "node_id";
/// File in data_dir holding the Raft log, vote and state machine.
pub const STORE_FILE: &str = "raft.redb";

/// Heartbeats and elections sized for a loopback/LAN cluster: a leader loss is
/// noticed within 1-2 s, and a busy 2-core machine does not trigger spurious
/// elections (heartbeat is 4-8x shorter than the election timeout).
const HEARTBEAT_MS: u64 = 250;
const ELECTION_MIN_MS: u64 = 1000;
const ELECTION_MAX_MS: u64 = 2000;
/// Upper bound on one proposal's round trip; a write that cannot commit in
/// this time has no quorum, and the caller should hear so instead of hanging.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum RaftError {
    #[error("cannot create data directory {path}: {source}")]
    DataDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("node id file {path}: {source}")]
    NodeIdIo {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "node id file {path} is corrupt ({detail}); restore it or wipe data_dir to join as a new node"
    )]
    NodeIdCorrupt { path: PathBuf, detail: String },
    #[error("cannot open Raft store {path}: {source}")]
    Store {
        path: PathBuf,
        #[source]
        source: StoreError,
    },
    #[error("invalid Raft configuration: {0}")]
    Config(String),
    #[error("cannot build the HTTP client for Raft RPC: {0}")]
    Http(#[source] reqwest::Error),
    #[error("Raft stopped: {0}")]
    Fatal(String),
    #[error("this node already belongs to a Raft cluster")]
    AlreadyInitialized,
    #[error("cannot initialize the Raft cluster: {0}")]
    Initialize(String),
}

/// Why a proposal or membership change did not happen. `ForwardToLeader` is
/// not a failure for the API: it proxies the request to that URL.
#[derive(Debug, Clone, thiserror::Error)]
pub enum WriteError {
    #[error("this node is not the Raft leader; node {leader_id} at {leader_url} is")]
    ForwardToLeader { leader_id: u64, leader_url: String },
    #[error("no Raft leader (election in progress or no quorum of voters reachable)")]
    NoLeader,
    #[error("membership change rejected: {0}")]
    Membership(String),
    #[error("timed out after {}s waiting for {what}", after.as_secs())]
    Timeout { after: Duration, what: String },
    #[error("Raft stopped: {0}")]
    Fatal(String),
}

/// Reads this agent's node id from data_dir, creating it on first start.
pub fn load_or_create_node_id(data_dir: &Path) -> Result<u64, RaftError> {
    let path = data_dir.join(NODE_ID_FILE);
    let io = |source| RaftError::NodeIdIo {
        path: path.clone(),
        source,
    };
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let corrupt = |detail: String| RaftError::NodeIdCorrupt {
                path: path.clone(),
                detail,
            };
            let id: u64 = text
                .trim()
                .parse()
                .map_err(|e| corrupt(format!("{e}: {:?}", text.trim())))?;
            if id == 0 {
                return Err(corrupt("id 0 is reserved".into()));
            }
            Ok(id)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(data_dir).map_err(|source| RaftError::DataDir {
                path: data_dir.to_owned(),
                source,
            })?;
            let id = random_node_id();
            // Write-then-rename, fsync'd: a crash leaves either no id or the
            // whole id, never a truncated one that would silently change identity.
            let tmp = data_dir.join(format!("{NODE_ID_FILE}.tmp"));
            let mut f = std::fs::File::create(&tmp).map_err(io)?;
            writeln!(f, "{id}").map_err(io)?;
            f.sync_all().map_err(io)?;
            std::fs::rename(&tmp, &path).map_err(io)?;
            if let Ok(dir) = std::fs::File::open(data_dir) {
                dir.sync_all().map_err(io)?;
            }
            tracing::info!(node_id = id, path = %path.display(), "generated a new Raft node id");
            Ok(id)
        }
        Err(e) => Err(io(e)),
    }
}

/// A random id in [1, 2^53): 53 random bits make collisions practically
/// impossible, and ids stay exact in JSON tools that parse numbers as doubles
/// (jq, JavaScript).
fn random_node_id() -> u64 {
    loop {
        let id = uuid::Uuid::new_v4().as_u64_pair().0 & ((1u64 << 53) - 1);
        if id != 0 {
            return id;
        }
    }
}

/// Handle to the local Raft instance. Cheap to clone.
#[derive(Clone)]
pub struct RaftNode {
    inner: Arc<Inner>,
}

struct Inner {
    id: u64,
    api_url: String,
    raft: Raft<TypeConfig>,
    cluster: watch::Receiver<ClusterState>,
    http: reqwest::Client,
    /// Lets `shutdown` wait until openraft's tasks have dropped the store.
    db: Weak<redb::Database>,
}

/// Opens the store in `data_dir` and starts Raft. `advertise_url` is how peers
/// reach this agent's API; `token` authenticates outgoing RPCs.
pub async fn start(
    node_id: u64,
    data_dir: &Path,
    advertise_url: &str,
    token: Arc<str>,
) -> Result<RaftNode, RaftError> {
    std::fs::create_dir_all(data_dir).map_err(|source| RaftError::DataDir {
        path: data_dir.to_owned(),
        source,
    })?;
    let store_path = data_dir.join(STORE_FILE);
    let store_err = |source| RaftError::Store {
        path: store_path.clone(),
        source,
    };
    let db = open_db_waiting(&store_path).await.map_err(store_err)?;
    let (sm, cluster) = StateMachine::open(Arc::clone(&db)).map_err(store_err)?;
    let db_handle = Arc::downgrade(&db);
    let log = LogStore::new(db);

    let config = Config {
        cluster_name: "mm".into(),
        heartbeat_interval: HEARTBEAT_MS,
        election_timeout_min: ELECTION_MIN_MS,
        election_timeout_max: ELECTION_MAX_MS,
        install_snapshot_timeout: 5000,
        // The state is tiny; snapshot every 1000 entries and keep as many, so
        // a lagging learner usually catches up from the log.
        snapshot_policy: SnapshotPolicy::LogsSinceLast(1000),
        max_in_snapshot_log_to_keep: 1000,
        // JSON inflates bytes ~3.5x; keep each chunk well under the API's body limit.
        snapshot_max_chunk_size: 256 * 1024,
        ..Default::default()
    }
    .validate()
    .map_err(|e| RaftError::Config(e.to_string()))?;

    let http = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(2))
        .build()
        .map_err(RaftError::Http)?;
    let network = NetworkFactory::new(http.clone(), token, node_id);
    let raft = Raft::new(node_id, Arc::new(config), network, log, sm)
        .await
        .map_err(|e| RaftError::Fatal(e.to_string()))?;
    tracing::info!(node_id, api_url = advertise_url, "Raft started");
    Ok(RaftNode {
        inner: Arc::new(Inner {
            id: node_id,
            api_url: advertise_url.to_owned(),
            raft,
            cluster,
            http,
            db: db_handle,
        }),
    })
}

/// Opens the store, waiting up to 5 s while the file is locked: a Raft
/// instance of this process that was just shut down may still be closing it.
/// Another process (a second agent on the same data_dir) keeps it locked,
/// and then this fails.
async fn open_db_waiting(path: &Path) -> Result<Arc<redb::Database>, StoreError> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        match open_db(path) {
            Err(e) if e.is_already_open() && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => return other,
        }
    }
}

impl RaftNode {
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// This agent's advertised API URL (its Raft address).
    pub fn api_url(&self) -> &str {
        &self.inner.api_url
    }

    /// The applied cluster state: current value at once (restored from disk at
    /// start), then a new value after every applied batch.
    pub fn cluster(&self) -> watch::Receiver<ClusterState> {
        self.inner.cluster.clone()
    }

    /// An HTTP client for agent-to-agent calls (no default timeout: set one per request).
    pub fn http_client(&self) -> reqwest::Client {
        self.inner.http.clone()
    }

    pub async fn is_initialized(&self) -> Result<bool, RaftError> {
        self.inner
            .raft
            .is_initialized()
            .await
            .map_err(|e| RaftError::Fatal(e.to_string()))
    }

    /// Forms a one-node cluster with this node as the only voter.
    pub async fn initialize(&self, self_info: &NodeInfo) -> Result<(), RaftError> {
        let members = BTreeMap::from([(self.inner.id, BasicNode::new(&self_info.api_url))]);
        match self.inner.raft.initialize(members).await {
            Ok(()) => Ok(()),
            Err(openraft::error::RaftError::APIError(InitializeError::NotAllowed(_))) => {
                Err(RaftError::AlreadyInitialized)
            }
            Err(e) => Err(RaftError::Initialize(e.to_string())),
        }
    }

    /// Proposes a command and waits until it is applied here (the leader).
    pub async fn write(&self, req: ClusterRequest) -> Result<ClusterResponse, WriteError> {
        let fut = self.inner.raft.client_write(req);
        match tokio::time::timeout(WRITE_TIMEOUT, fut).await {
            Err(_) => Err(WriteError::Timeout {
                after: WRITE_TIMEOUT,
                what: "the cluster command to commit".into(),
            }),
            Ok(Ok(resp)) => Ok(resp.data),
            Ok(Err(e)) => Err(map_write_error(e)),
        }
    }

    /// Adds a non-voting member and waits (up to `timeout`) until it has caught
    /// up with the log. Re-adding an existing learner is a no-op.
    pub async fn add_learner(
        &self,
        id: u64,
        url: &str,
        timeout: Duration,
    ) -> Result<(), WriteError> {
        let fut = self.inner.raft.add_learner(id, BasicNode::new(url), true);
        match tokio::time::timeout(timeout, fut).await {
            Err(_) => Err(WriteError::Timeout {
                after: timeout,
                what: format!("learner {id} at {url} to catch up with the Raft log"),
            }),
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(map_write_error(e)),
        }
    }

    /// Makes exactly `voters` the voting members; other current members stay learners.
    pub async fn change_membership(&self, voters: BTreeSet<u64>) -> Result<(), WriteError> {
        self.membership(ChangeMembers::ReplaceAllVoters(voters))
            .await
    }

    /// Takes node `id` out of the membership in one change: a voter with
    /// `retain = false` (it does not stay a learner), a learner as a node.
    /// A leader may remove itself; it steps down once the change commits
    /// (a second change proposed after that made openraft's core panic).
    pub async fn remove_member(&self, id: u64) -> Result<(), WriteError> {
        let members = self.members();
        if members.voters.contains(&id) {
            self.membership(ChangeMembers::RemoveVoters(BTreeSet::from([id])))
                .await
        } else if members.learners.contains(&id) {
            self.membership(ChangeMembers::RemoveNodes(BTreeSet::from([id])))
                .await
        } else {
            Ok(())
        }
    }

    /// Waits (up to `timeout`, on the leader) until node `id` has every log
    /// entry this node has; gives up silently (the node may be down).
    pub async fn wait_replicated(&self, id: u64, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let done = {
                let m = self.inner.raft.metrics();
                let m = m.borrow();
                let matched = m
                    .replication
                    .as_ref()
                    .and_then(|r| r.get(&id))
                    .and_then(|l| l.as_ref())
                    .map(|l| l.index);
                matched.is_some() && matched >= m.last_log_index
            };
            if done || tokio::time::Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Promotes one learner to voter, leaving the other voters as they are.
    pub async fn promote_voter(&self, id: u64) -> Result<(), WriteError> {
        self.membership(ChangeMembers::AddVoterIds(BTreeSet::from([id])))
            .await
    }

    async fn membership(&self, change: ChangeMembers<u64, BasicNode>) -> Result<(), WriteError> {
        let fut = self.inner.raft.change_membership(change, false);
        match tokio::time::timeout(WRITE_TIMEOUT, fut).await {
            Err(_) => Err(WriteError::Timeout {
                after: WRITE_TIMEOUT,
                what: "the membership change to commit".into(),
            }),
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(map_write_error(e)),
        }
    }

    /// The current leader's id and API URL, as far as this node knows.
    pub fn leader(&self) -> Option<(u64, String)> {
        let m = self.inner.raft.metrics();
        let m = m.borrow();
        let id = m.current_leader?;
        let url = m.membership_config.membership().get_node(&id)?.addr.clone();
        Some((id, url))
    }

    pub fn is_leader(&self) -> bool {
        self.inner.raft.metrics().borrow().state == ServerState::Leader
    }

    pub fn term(&self) -> u64 {
        self.inner.raft.metrics().borrow().current_term
    }

    /// Voters and learners of the membership this node currently uses.
    pub fn members(&self) -> Members {
        let m = self.inner.raft.metrics();
        let m = m.borrow();
        let membership = m.membership_config.membership();
        Members {
            voters: membership.voter_ids().collect(),
            learners: membership.learner_ids().collect(),
        }
    }

    /// Waits until some node is known as leader; returns it.
    pub async fn wait_for_leader(&self, timeout: Duration) -> Result<(u64, String), WriteError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut metrics = self.inner.raft.metrics();
        loop {
            if let Some(l) = self.leader() {
                return Ok(l);
            }
            match tokio::time::timeout_at(deadline, metrics.changed()).await {
                Err(_) => {
                    return Err(WriteError::Timeout {
                        after: timeout,
                        what: "a Raft leader to be elected".into(),
                    });
                }
                Ok(Err(_)) => return Err(WriteError::Fatal("Raft has shut down".into())),
                Ok(Ok(())) => {}
            }
        }
    }

    /// Handles an inbound Raft RPC body for the HTTP API.
    pub async fn handle_rpc(&self, kind: RpcKind, body: &[u8]) -> Result<Vec<u8>, RpcServeError> {
        network::serve_rpc(&self.inner.raft, kind, body).await
    }

    /// Stops Raft and waits (up to 10 s) until the store file is closed, so
    /// the same data_dir can be opened again right away.
    pub async fn shutdown(&self) -> Result<(), RaftError> {
        self.inner
            .raft
            .shutdown()
            .await
            .map_err(|e| RaftError::Fatal(format!("Raft task failed while stopping: {e}")))?;
        // openraft's replication and state-machine tasks finish shortly after
        // the core; they hold the store until then.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while self.inner.db.strong_count() > 0 {
            if tokio::time::Instant::now() >= deadline {
                return Err(RaftError::Fatal(
                    "Raft stopped but its store is still in use after 10s".into(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }
}

fn map_write_error(
    e: openraft::error::RaftError<u64, ClientWriteError<u64, BasicNode>>,
) -> WriteError {
    match e {
        openraft::error::RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => {
            match (f.leader_id, f.leader_node) {
                (Some(leader_id), Some(node)) => WriteError::ForwardToLeader {
                    leader_id,
                    leader_url: node.addr,
                },
                _ => WriteError::NoLeader,
            }
        }
        openraft::error::RaftError::APIError(ClientWriteError::ChangeMembershipError(c)) => {
            WriteError::Membership(c.to_string())
        }
        openraft::error::RaftError::Fatal(f) => WriteError::Fatal(f.to_string()),
    }
}
