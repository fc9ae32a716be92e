//! add-node, run by the Raft leader for `POST /v1/nodes`.
//!
//! The protocol is a sequence of named steps. Each step is idempotent and its
//! completion is visible in Raft (the node's entry and state, the Raft
//! membership), so re-running add-node for a node that is already `joining`
//! resumes where it stopped, and for an `active` node it is a no-op.
//!
//! 1. `fetch_info`: ask the new agent who it is (name must match; id unused).
//! 2. `record_joining`: `AddNode { state: joining }`; the data plane on every
//!    node now creates slots and streams to and from it.
//! 3. `add_learner`: Raft learner, blocking until it has caught up with the log.
//!    With the data plane running, the node was recorded `syncing` with a
//!    source (`AddSyncingNode`): `wait_synced` waits for its agent's copy
//!    (`sync`: schema, rows with their versions, tombstones, progress), and
//!    `SetNodeState { joining }` then lets every stream into it start.
//! 4. `wait_streams`: every other active node streams into the new node and
//!    the new node streams into every other active node.
//! 5. `promote`: the new node becomes a voter.
//! 6. `mark_active`: `SetNodeState { active }`.

use std::time::Duration;

use mm_proto::api::{InfoResponse, NodeInfo, NodeState, StatusResponse, StreamState};

use crate::raft::{
    ClusterRequest, ClusterResponse, ClusterState, RaftNode, WriteError, is_valid_node_name,
};

/// Timeouts for add-node.
#[derive(Debug, Clone)]
pub struct JoinOptions {
    /// How long the new learner may take to catch up with the Raft log.
    pub catch_up_timeout: Duration,
    /// How long the data plane may take to get every stream to and from the
    /// new node streaming.
    pub streams_timeout: Duration,
    pub poll_interval: Duration,
    /// False only where no data plane runs (control-plane tests): step 4 is
    /// skipped, and no data is copied. A real agent always waits.
    pub wait_for_streams: bool,
    /// How long the new node's initial copy may take.
    pub sync_timeout: Duration,
}

impl Default for JoinOptions {
    fn default() -> Self {
        Self {
            catch_up_timeout: Duration::from_secs(60),
            streams_timeout: Duration::from_secs(300),
            poll_interval: Duration::from_millis(200),
            wait_for_streams: true,
            sync_timeout: Duration::from_secs(24 * 3600),
        }
    }
}

impl JoinOptions {
    /// An upper bound for the whole protocol, for callers that proxy it.
    pub fn total_timeout(&self) -> Duration {
        self.catch_up_timeout + self.streams_timeout + self.sync_timeout + Duration::from_secs(60)
    }
}

/// Timeout of one status/info call to an agent.
const AGENT_CALL_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error("invalid add-node request: {0}")]
    Invalid(String),
    #[error("cannot reach the agent at {url}: {detail}")]
    Unreachable { url: String, detail: String },
    #[error("{0}")]
    Refused(String),
    #[error("add-node step '{step}' failed: {source}")]
    Raft {
        step: &'static str,
        #[source]
        source: WriteError,
    },
    #[error("{0}")]
    StreamsNotReady(String),
}

/// Adds (or finishes adding) the agent at `url`, which must call itself `name`.
/// Runs on the leader; returns the node as recorded when it is active.
pub async fn add_node(
    raft: &RaftNode,
    token: &str,
    opts: &JoinOptions,
    name: &str,
    url: &str,
    source: Option<&str>,
) -> Result<NodeInfo, JoinError> {
    if !is_valid_node_name(name) {
        return Err(JoinError::Invalid(format!(
            "node name {name:?} is not 1-32 characters of [a-z0-9_-]"
        )));
    }
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err(JoinError::Invalid(format!(
            "agent URL {url:?} must start with http:// or https://"
        )));
    }
    let url = url.trim_end_matches('/');

    tracing::info!(
        node = name,
        url,
        "add-node 1/6: asking the new agent who it is"
    );
    let info = fetch_info(raft, token, url).await?;
    let plan = plan(&raft.cluster().borrow(), &info, name)?;
    let node = match plan {
        Plan::AlreadyActive(n) => {
            tracing::info!(node = name, "add-node: already active, nothing to do");
            return Ok(n);
        }
        Plan::Resume(n) => {
            tracing::info!(node = name, state = %n.state, "add-node 2/6: already recorded, resuming");
            n
        }
        Plan::New(n) if opts.wait_for_streams => {
            let source = choose_source(raft, token, source).await?;
            tracing::info!(
                node = name,
                node_id = n.id,
                %source,
                "add-node 2/6: recording the node as syncing from {source}"
            );
            write(
                raft,
                "record syncing",
                ClusterRequest::AddSyncingNode {
                    node: n.clone(),
                    source,
                },
            )
            .await?;
            NodeInfo {
                state: NodeState::Syncing,
                ..n
            }
        }
        Plan::New(n) => {
            tracing::info!(
                node = name,
                node_id = n.id,
                "add-node 2/6: recording the node as joining"
            );
            record_joining(raft, &n).await?;
            n
        }
    };

    tracing::info!(
        node = name,
        "add-node 3/6: adding it as a Raft learner and replicating the log"
    );
    add_learner(raft, &node, opts).await?;

    if node.state == NodeState::Syncing {
        tracing::info!(
            node = name,
            "add-node 3/6: waiting for the new node's copy of the data"
        );
        wait_synced(raft, token, opts, &node).await?;
        write(
            raft,
            "start the streams into the new node",
            ClusterRequest::SetNodeState {
                name: node.name.clone(),
                state: NodeState::Joining,
            },
        )
        .await?;
    }

    if opts.wait_for_streams {
        tracing::info!(
            node = name,
            "add-node 4/6: waiting for streams to and from every active node"
        );
        wait_streams(raft, token, opts, &node).await?;
    } else {
        tracing::info!(node = name, "add-node 4/6: stream wait disabled, skipping");
    }

    tracing::info!(node = name, "add-node 5/6: promoting it to Raft voter");
    promote(raft, &node).await?;

    tracing::info!(node = name, "add-node 6/6: marking it active");
    mark_active(raft, &node).await?;
    tracing::info!(node = name, node_id = node.id, "add-node: done");
    Ok(NodeInfo {
        state: NodeState::Active,
        ..node
    })
}

enum Plan {
    AlreadyActive(NodeInfo),
    Resume(NodeInfo),
    New(NodeInfo),
}

/// Step 1.
async fn fetch_info(raft: &RaftNode, token: &str, url: &str) -> Result<InfoResponse, JoinError> {
    get_json(raft, token, url, "/v1/info")
        .await
        .map_err(|detail| JoinError::Unreachable {
            url: url.to_owned(),
            detail,
        })
}

/// Decides, from the replicated state alone, whether this is a new join, a
/// resumption, or already done; refuses identities that clash.
fn plan(state: &ClusterState, info: &InfoResponse, name: &str) -> Result<Plan, JoinError> {
    if info.name != name {
        return Err(JoinError::Refused(format!(
            "the agent at {} is node {:?}, not {name:?}",
            info.api_url, info.name
        )));
    }
    if state.removed_ids.contains(&info.node_id) {
        return Err(JoinError::Refused(format!(
            "node {name} has id {} which belonged to a removed node; wipe its data_dir so it gets a new id",
            info.node_id
        )));
    }
    if let Some(existing) = state.node_by_name(name) {
        if existing.id != info.node_id {
            return Err(JoinError::Refused(format!(
                "a node named {name} already exists with id {}, but the agent at {} has id {} \
                 (remove-node {name} first if it was rebuilt)",
                existing.id, info.api_url, info.node_id
            )));
        }
        return match existing.state {
            NodeState::Active => Ok(Plan::AlreadyActive(existing.clone())),
            NodeState::Joining | NodeState::Syncing => Ok(Plan::Resume(existing.clone())),
            NodeState::Parting => Err(JoinError::Refused(format!(
                "node {name} is being removed; finish remove-node before adding it again"
            ))),
        };
    }
    if let Some(other) = state.nodes.get(&info.node_id) {
        return Err(JoinError::Refused(format!(
            "the agent at {} has id {}, already used by node {}",
            info.api_url, info.node_id, other.name
        )));
    }
    if info.raft_initialized {
        return Err(JoinError::Refused(format!(
            "node {name} already belongs to a Raft cluster (was `mmctl init` run on it?); \
             wipe its data_dir to add it to this one"
        )));
    }
    Ok(Plan::New(NodeInfo {
        id: info.node_id,
        name: name.to_owned(),
        api_url: info.api_url.trim_end_matches('/').to_owned(),
        peer_dsn: info.peer_dsn.clone(),
        state: NodeState::Joining,
    }))
}

/// Step 2.
async fn record_joining(raft: &RaftNode, node: &NodeInfo) -> Result<(), JoinError> {
    write(
        raft,
        "record joining",
        ClusterRequest::AddNode(node.clone()),
    )
    .await
}

/// Step 3. Uses the node's advertised URL: that is how every member will reach it.
async fn add_learner(
    raft: &RaftNode,
    node: &NodeInfo,
    opts: &JoinOptions,
) -> Result<(), JoinError> {
    raft.add_learner(node.id, &node.api_url, opts.catch_up_timeout)
        .await
        .map_err(|source| JoinError::Raft {
            step: "add learner",
            source,
        })
}

/// `--source`, or the active node that is least behind its peers (the
/// smallest total lag into it); ties go to the first by name.
async fn choose_source(
    raft: &RaftNode,
    token: &str,
    asked: Option<&str>,
) -> Result<String, JoinError> {
    let state = raft.cluster().borrow().clone();
    let active: Vec<NodeInfo> = state
        .nodes
        .values()
        .filter(|n| n.state == NodeState::Active)
        .cloned()
        .collect();
    if let Some(name) = asked {
        return match active.iter().find(|n| n.name == name) {
            Some(n) => Ok(n.name.clone()),
            None => Err(JoinError::Invalid(format!(
                "--source {name} is not an active node of this cluster"
            ))),
        };
    }
    let mut best: Option<(u64, String)> = None;
    for n in &active {
        let lag = match get_json::<StatusResponse>(raft, token, &n.api_url, "/v1/status").await {
            Ok(s) => s
                .streams
                .iter()
                .map(|st| st.lag_bytes.unwrap_or(u64::MAX / 64))
                .sum::<u64>(),
            Err(_) => continue,
        };
        if best
            .as_ref()
            .is_none_or(|(l, b)| lag < *l || (lag == *l && n.name < *b))
        {
            best = Some((lag, n.name.clone()));
        }
    }
    best.map(|(_, n)| n).ok_or_else(|| {
        JoinError::Refused("no active node answers: there is no node to copy the data from".into())
    })
}

/// Waits for the new node's agent to report its copy done.
async fn wait_synced(
    raft: &RaftNode,
    token: &str,
    opts: &JoinOptions,
    node: &NodeInfo,
) -> Result<(), JoinError> {
    let started = tokio::time::Instant::now();
    let mut last_report = started;
    // A refusal counts once the copy tried again after this wait began
    // (an operator who fixed the schema reruns add-node).
    let mut first_attempt: Option<u64> = None;
    loop {
        let r = get_json::<mm_proto::api::SyncReport>(raft, token, &node.api_url, "/v1/sync").await;
        if let Ok(rep) = &r {
            let first = *first_attempt.get_or_insert(rep.attempts);
            if rep.phase == "refused" && rep.attempts > first {
                return Err(JoinError::Refused(format!(
                    "node {} cannot take the data: {} (fix it and run add-node again, or remove-node {})",
                    node.name,
                    rep.error.clone().unwrap_or_default(),
                    node.name
                )));
            }
        }
        let now = match &r {
            Ok(rep) if rep.phase == "done" => return Ok(()),
            Ok(rep) => match &rep.error {
                Some(e) => format!("{}: {} (last attempt failed: {e})", rep.phase, rep.detail),
                None => format!("{}: {}", rep.phase, rep.detail),
            },
            Err(e) => format!("cannot read its copy's progress: {e}"),
        };
        if started.elapsed() >= opts.sync_timeout {
            return Err(JoinError::StreamsNotReady(format!(
                "node {} has not finished copying its data after {}s: {now}",
                node.name,
                started.elapsed().as_secs()
            )));
        }
        if last_report.elapsed() >= Duration::from_secs(10) {
            last_report = tokio::time::Instant::now();
            tracing::info!(node = %node.name, progress = %now, "add-node 3/6: copying");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Step 4: polls every involved agent's status until all pairs stream.
async fn wait_streams(
    raft: &RaftNode,
    token: &str,
    opts: &JoinOptions,
    node: &NodeInfo,
) -> Result<(), JoinError> {
    let started = tokio::time::Instant::now();
    let mut last_report = started;
    loop {
        let pending = pending_streams(raft, token, node).await;
        if pending.is_empty() {
            return Ok(());
        }
        let waited = started.elapsed();
        if waited >= opts.streams_timeout {
            return Err(JoinError::StreamsNotReady(format!(
                "streams of node {} not streaming after {}s: {}",
                node.name,
                waited.as_secs(),
                pending.join("; ")
            )));
        }
        if last_report.elapsed() >= Duration::from_secs(10) {
            last_report = tokio::time::Instant::now();
            tracing::info!(node = %node.name, waiting_for = %pending.join("; "), "add-node 4/6: still waiting");
        }
        tokio::time::sleep(opts.poll_interval).await;
    }
}

/// The pairs involving `node` that are not streaming yet, each described
/// with its state and last error. Empty when every pair streams.
async fn pending_streams(raft: &RaftNode, token: &str, node: &NodeInfo) -> Vec<String> {
    let state = raft.cluster().borrow().clone();
    let others: Vec<NodeInfo> = state
        .nodes
        .values()
        .filter(|n| n.id != node.id && n.state == NodeState::Active)
        .cloned()
        .collect();
    let mut pending = Vec::new();
    let new_status = get_json::<StatusResponse>(raft, token, &node.api_url, "/v1/status").await;
    for other in &others {
        // other → node, reported by node.
        match &new_status {
            Ok(s) => {
                if let Some(p) = pair_problem(s, &other.name, &node.name, &state) {
                    pending.push(p);
                }
            }
            Err(e) => pending.push(format!(
                "{} → {}: cannot read {}'s status: {e}",
                other.name, node.name, node.name
            )),
        }
        // node → other, reported by other.
        match get_json::<StatusResponse>(raft, token, &other.api_url, "/v1/status").await {
            Ok(s) => {
                if let Some(p) = pair_problem(&s, &node.name, &other.name, &state) {
                    pending.push(p);
                }
            }
            Err(e) => pending.push(format!(
                "{} → {}: cannot read {}'s status: {e}",
                node.name, other.name, other.name
            )),
        }
    }
    pending
}

/// Why the stream from `from` in `to`'s status is not ready, if it is not.
/// A paused pair counts as ready: the operator asked for it, and its slot and
/// stream exist.
fn pair_problem(
    status: &StatusResponse,
    from: &str,
    to: &str,
    state: &ClusterState,
) -> Option<String> {
    let Some(stream) = status.streams.iter().find(|s| s.from == from) else {
        return Some(format!("{from} → {to}: no stream yet"));
    };
    match stream.state {
        StreamState::Streaming => None,
        StreamState::Paused if state.is_paused(from, to) => None,
        other => {
            let state_name = serde_json::to_value(other)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_else(|| format!("{other:?}"));
            Some(match &stream.last_error {
                Some(e) => format!("{from} → {to}: {state_name}, last error: {e}"),
                None => format!("{from} → {to}: {state_name}"),
            })
        }
    }
}

/// Step 5.
async fn promote(raft: &RaftNode, node: &NodeInfo) -> Result<(), JoinError> {
    if raft.members().voters.contains(&node.id) {
        return Ok(());
    }
    raft.promote_voter(node.id)
        .await
        .map_err(|source| JoinError::Raft {
            step: "promote to voter",
            source,
        })
}

/// Step 6.
async fn mark_active(raft: &RaftNode, node: &NodeInfo) -> Result<(), JoinError> {
    let req = ClusterRequest::SetNodeState {
        name: node.name.clone(),
        state: NodeState::Active,
    };
    write(raft, "mark active", req).await
}

async fn write(raft: &RaftNode, step: &'static str, req: ClusterRequest) -> Result<(), JoinError> {
    match raft.write(req).await {
        Ok(ClusterResponse::Ok) => Ok(()),
        Ok(ClusterResponse::Error(e)) => Err(JoinError::Refused(e)),
        Err(source) => Err(JoinError::Raft { step, source }),
    }
}

/// GET `base + path` from another agent with the cluster token; the error is
/// one line for operators.
async fn get_json<T: serde::de::DeserializeOwned>(
    raft: &RaftNode,
    token: &str,
    base: &str,
    path: &str,
) -> Result<T, String> {
    let url = format!("{}{path}", base.trim_end_matches('/'));
    let resp = raft
        .http_client()
        .get(&url)
        .bearer_auth(token)
        .timeout(AGENT_CALL_TIMEOUT)
        .send()
        .await
        .map_err(|e| describe_reqwest(&e))?;
    let status = resp.status();
    let body = resp.bytes().await.map_err(|e| describe_reqwest(&e))?;
    if !status.is_success() {
        let msg = serde_json::from_slice::<mm_proto::api::ErrorBody>(&body)
            .map(|b| b.error)
            .unwrap_or_else(|_| String::from_utf8_lossy(&body).chars().take(200).collect());
        return Err(format!("HTTP {}: {msg}", status.as_u16()));
    }
    serde_json::from_slice(&body).map_err(|e| format!("unexpected answer from {url}: {e}"))
}

/// reqwest's Display stops at "error sending request"; the cause is deeper.
pub(crate) fn describe_reqwest(e: &reqwest::Error) -> String {
    if e.is_timeout() {
        return "timed out".into();
    }
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        msg = s.to_string();
        src = s.source();
    }
    msg
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;

    fn info(name: &str, id: u64, initialized: bool) -> InfoResponse {
        InfoResponse {
            name: name.into(),
            node_id: id,
            api_url: format!("http://127.0.0.1:{id}"),
            peer_dsn: "host=x".into(),
            raft_initialized: initialized,
        }
    }

    fn cluster() -> ClusterState {
        let mut s = ClusterState::default();
        for (id, name, st) in [(1, "n1", NodeState::Active), (2, "n2", NodeState::Joining)] {
            s.apply(&ClusterRequest::AddNode(NodeInfo {
                id,
                name: name.into(),
                api_url: format!("http://127.0.0.1:{id}"),
                peer_dsn: "host=x".into(),
                state: st,
            }));
        }
        s.removed_ids.insert(9);
        s
    }

    #[test]
    fn plan_decides_new_resume_noop_and_refusals() {
        let s = cluster();
        assert!(
            matches!(plan(&s, &info("n3", 3, false), "n3"), Ok(Plan::New(n)) if n.state == NodeState::Joining && n.id == 3)
        );
        assert!(matches!(
            plan(&s, &info("n2", 2, true), "n2"),
            Ok(Plan::Resume(_))
        ));
        assert!(matches!(
            plan(&s, &info("n1", 1, true), "n1"),
            Ok(Plan::AlreadyActive(_))
        ));
        let refused = |r: Result<Plan, JoinError>, needle: &str| match r {
            Err(JoinError::Refused(m)) => assert!(m.contains(needle), "{m}"),
            Err(e) => panic!("wrong error {e}"),
            Ok(_) => panic!("accepted; expected refusal containing {needle:?}"),
        };
        refused(plan(&s, &info("n4", 4, false), "n3"), "not \"n3\"");
        refused(plan(&s, &info("n3", 9, false), "n3"), "removed");
        refused(
            plan(&s, &info("n2", 5, false), "n2"),
            "already exists with id 2",
        );
        refused(
            plan(&s, &info("n3", 1, false), "n3"),
            "already used by node n1",
        );
        refused(
            plan(&s, &info("n3", 3, true), "n3"),
            "already belongs to a Raft cluster",
        );
    }
}
