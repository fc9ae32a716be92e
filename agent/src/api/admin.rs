//! Admin endpoints (JSON) used by mmctl, and `/metrics`.
//!
//! Cluster writes must run on the Raft leader. A follower proxies them to the
//! leader with the same body and the cluster token, so mmctl can talk to any
//! agent. A proxied request is marked; a node that receives a marked request
//! but is not leader answers 503 instead of proxying again (no loops while
//! leadership moves).

use std::fmt::Write as _;
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use mm_proto::Lsn;
use mm_proto::api::{
    AddNodeRequest, InfoResponse, InitResponse, LeaderInfo, NodeInfo, NodeState, PairRequest,
    PauseResponse, PendingRequest, PendingResponse, StatusResponse, WalLsnResponse,
};
use serde::Serialize;

use super::{ApiError, ApiJson, AppState, FORWARDED_HEADER};
use crate::join::{self, JoinError};
use crate::raft::{ClusterRequest, ClusterResponse, RaftError, WriteError};

/// Proxied pause/resume: one Raft write plus a hop.
pub(super) const FORWARD_TIMEOUT: Duration = Duration::from_secs(30);
/// How long `init` waits for the fresh one-node cluster to elect itself.
const INIT_LEADER_TIMEOUT: Duration = Duration::from_secs(10);

pub(super) async fn info(State(s): State<AppState>) -> Result<Json<InfoResponse>, ApiError> {
    Ok(Json(InfoResponse {
        name: s.node_name.clone(),
        node_id: s.raft.id(),
        api_url: s.api_url.clone(),
        peer_dsn: s.peer_dsn.clone(),
        raft_initialized: s.raft.is_initialized().await.map_err(raft_error)?,
    }))
}

fn self_info(s: &AppState, state: NodeState) -> NodeInfo {
    NodeInfo {
        id: s.raft.id(),
        name: s.node_name.clone(),
        api_url: s.api_url.clone(),
        peer_dsn: s.peer_dsn.clone(),
        state,
    }
}

/// Bootstraps a one-node cluster with this agent. Also finishes an init that
/// was interrupted between forming the Raft group and recording the node.
pub(super) async fn init(State(s): State<AppState>) -> Result<Json<InitResponse>, ApiError> {
    let me = self_info(&s, NodeState::Active);
    let already = s.raft.is_initialized().await.map_err(raft_error)?;
    if already {
        let unfinished = s.raft.cluster().borrow().nodes.is_empty()
            && s.raft.members().voters == [me.id]
            && s.raft.members().learners.is_empty();
        if !unfinished {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "this agent already belongs to a cluster (init runs once, on the first node; use add-node for the others)",
            ));
        }
        tracing::info!("init: finishing an interrupted init");
    } else {
        match s.raft.initialize(&me).await {
            Ok(()) => {
                tracing::info!(node = %me.name, node_id = me.id, "init: formed a one-node Raft cluster")
            }
            Err(RaftError::AlreadyInitialized) => {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    "this agent already belongs to a cluster",
                ));
            }
            Err(e) => return Err(raft_error(e)),
        }
    }
    let (leader, _) = s
        .raft
        .wait_for_leader(INIT_LEADER_TIMEOUT)
        .await
        .map_err(|e| write_error("init", e))?;
    if leader != me.id {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            format!("another node ({leader}) leads this cluster; init runs only on a new cluster"),
        ));
    }
    match s.raft.write(ClusterRequest::AddNode(me.clone())).await {
        Ok(ClusterResponse::Ok) => Ok(Json(InitResponse {
            name: me.name,
            node_id: me.id,
        })),
        Ok(ClusterResponse::Error(e)) => Err(ApiError::new(StatusCode::CONFLICT, e)),
        Err(e) => Err(write_error("init", e)),
    }
}

pub(super) async fn add_node(
    State(s): State<AppState>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<AddNodeRequest>,
) -> Result<Response, ApiError> {
    if let Some(url) = leader_elsewhere(&s, &headers)? {
        return forward(&s, &url, "/v1/nodes", &req, s.join.total_timeout()).await;
    }
    match join::add_node(
        &s.raft,
        &s.token,
        &s.join,
        &req.name,
        &req.url,
        req.source.as_deref(),
    )
    .await
    {
        Ok(node) => Ok(Json(node).into_response()),
        Err(JoinError::Raft {
            source: WriteError::ForwardToLeader { leader_url, .. },
            ..
        }) if !is_forwarded(&headers) => {
            forward(&s, &leader_url, "/v1/nodes", &req, s.join.total_timeout()).await
        }
        Err(e) => Err(join_error(e)),
    }
}

pub(super) async fn pause(
    State(s): State<AppState>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<PairRequest>,
) -> Result<Response, ApiError> {
    set_paused(s, headers, req, true).await
}

pub(super) async fn resume(
    State(s): State<AppState>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<PairRequest>,
) -> Result<Response, ApiError> {
    set_paused(s, headers, req, false).await
}

async fn set_paused(
    s: AppState,
    headers: HeaderMap,
    req: PairRequest,
    paused: bool,
) -> Result<Response, ApiError> {
    let path = if paused { "/v1/pause" } else { "/v1/resume" };
    if req.from == req.to {
        return Err(ApiError::bad_request(format!(
            "--from and --to must be different nodes (both are {})",
            req.from
        )));
    }
    if let Some(url) = leader_elsewhere(&s, &headers)? {
        return forward(&s, &url, path, &req, FORWARD_TIMEOUT).await;
    }
    // Checked here for a clear 404; the state machine checks again on apply.
    {
        let state = s.raft.cluster();
        let state = state.borrow();
        for name in [&req.from, &req.to] {
            if state.node_by_name(name).is_none() {
                return Err(ApiError::new(
                    StatusCode::NOT_FOUND,
                    format!("unknown node {name}"),
                ));
            }
        }
    }
    let cmd = ClusterRequest::SetPaused {
        from: req.from.clone(),
        to: req.to.clone(),
        paused,
    };
    match s.raft.write(cmd).await {
        Ok(ClusterResponse::Ok) => {
            tracing::info!(from = %req.from, to = %req.to, paused, "stream pause state changed");
            Ok(Json(PauseResponse {
                from: req.from,
                to: req.to,
                paused,
            })
            .into_response())
        }
        Ok(ClusterResponse::Error(e)) => Err(ApiError::new(StatusCode::CONFLICT, e)),
        Err(WriteError::ForwardToLeader { leader_url, .. }) if !is_forwarded(&headers) => {
            forward(&s, &leader_url, path, &req, FORWARD_TIMEOUT).await
        }
        Err(e) => Err(write_error(if paused { "pause" } else { "resume" }, e)),
    }
}

/// This node's add-node copy (`mmctl add-node` shows it while it runs).
pub(super) async fn sync(State(s): State<AppState>) -> Json<mm_proto::api::SyncReport> {
    Json(s.sync.snapshot())
}

pub(super) async fn status(State(s): State<AppState>) -> Json<StatusResponse> {
    let state = s.raft.cluster().borrow().clone();
    let leader = s.raft.leader().map(|(id, url)| LeaderInfo {
        id,
        name: state.nodes.get(&id).map(|n| n.name.clone()),
        url,
    });
    Json(StatusResponse {
        node: s.node_name.clone(),
        node_id: s.raft.id(),
        leader,
        term: s.raft.term(),
        last_applied_index: state.last_applied_index,
        members: s.raft.members(),
        nodes: state.nodes.values().cloned().collect(),
        paused: state.paused.iter().cloned().collect(),
        streams: s.status.snapshot(),
        tombstones: s.status.tombstones(),
        sequences: crate::sequences::status(&state),
    })
}

pub(super) async fn wal_lsn(State(s): State<AppState>) -> Result<Json<WalLsnResponse>, ApiError> {
    let client = crate::pg::connect(&s.local_dsn, s.local_password.as_deref())
        .await
        .map_err(|e| ApiError::unavailable(format!("local PostgreSQL: {e}")))?;
    let unavailable = |what: &str, e: tokio_postgres::Error| {
        ApiError::unavailable(format!("local PostgreSQL: {what}: {e}"))
    };
    // Due compensating deletes first, so the position covers them.
    let compensations_waiting = crate::compensate::drain(&client, &s.gate)
        .await
        .map_err(|e| unavailable("sending compensating deletes", e))?;
    let compensations = crate::compensate::recorded(&client)
        .await
        .map_err(|e| unavailable("mm.compensations", e))?;
    let row = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .map_err(|e| {
            ApiError::unavailable(format!("local PostgreSQL: pg_current_wal_lsn(): {e}"))
        })?;
    let text: String = row.try_get(0).map_err(|e| {
        ApiError::internal(format!(
            "pg_current_wal_lsn() returned an unexpected type: {e}"
        ))
    })?;
    let lsn: Lsn = text
        .parse()
        .map_err(|e| ApiError::internal(format!("pg_current_wal_lsn(): {e}")))?;
    Ok(Json(WalLsnResponse {
        lsn,
        compensations,
        compensations_waiting,
    }))
}

/// Peeks at `from`'s slot for this node (see `PendingRequest`).
pub(super) async fn pending(
    State(s): State<AppState>,
    ApiJson(req): ApiJson<PendingRequest>,
) -> Result<Json<PendingResponse>, ApiError> {
    let peer_dsn = s
        .raft
        .cluster()
        .borrow()
        .node_by_name(&req.from)
        .map(|n| n.peer_dsn.clone())
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::NOT_FOUND,
                format!("node {} is not a member of the cluster", req.from),
            )
        })?;
    let client = crate::pg::connect(&peer_dsn, s.local_password.as_deref())
        .await
        .map_err(|e| ApiError::unavailable(format!("node {}'s PostgreSQL: {e}", req.from)))?;
    let slot = crate::stream::names::slot_name(&req.from, &s.node_name);
    let first_commit_ts = crate::lag::first_pending_commit(&client, &slot, req.upto)
        .await
        .map_err(|e| {
            ApiError::unavailable(format!(
                "cannot read slot {slot} on node {}: {}",
                req.from,
                e.as_db_error()
                    .map_or_else(|| e.to_string(), |d| d.message().to_owned())
            ))
        })?;
    Ok(Json(PendingResponse { first_commit_ts }))
}

/// The data plane's per-stream metrics followed by the control plane's.
pub(super) async fn metrics(State(s): State<AppState>) -> Response {
    let mut out = crate::metrics::render(&s.status);
    let state = s.raft.cluster().borrow().clone();
    let node = escape_label(&s.node_name);
    let gauges: [(&str, &str, u64); 5] = [
        ("mm_raft_term", "current Raft term", s.raft.term()),
        (
            "mm_raft_is_leader",
            "1 if this agent is the Raft leader",
            u64::from(s.raft.is_leader()),
        ),
        (
            "mm_raft_last_applied_index",
            "last Raft log index applied to the cluster state",
            state.last_applied_index,
        ),
        (
            "mm_cluster_nodes",
            "nodes in the cluster state, any state",
            state.nodes.len() as u64,
        ),
        (
            "mm_cluster_paused_streams",
            "streams paused by mmctl pause",
            state.paused.len() as u64,
        ),
    ];
    for (name, help, value) in gauges {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{node=\"{node}\"}} {value}"
        );
    }
    // Exhaustion of a global sequence shows long before it happens.
    if !state.sequences.is_empty() {
        out.push_str(
            "# HELP mm_sequence_values_left values of a global sequence not handed out to any node yet\n# TYPE mm_sequence_values_left gauge\n",
        );
        for (name, g) in &state.sequences {
            let left = crate::sequences::values_left(g);
            let _ = writeln!(
                out,
                "mm_sequence_values_left{{node=\"{node}\",sequence=\"{}\"}} {left}",
                escape_label(name)
            );
        }
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        out,
    )
        .into_response()
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

pub(super) fn is_forwarded(headers: &HeaderMap) -> bool {
    headers.contains_key(FORWARDED_HEADER)
}

/// Where to send a cluster write: None = handle here (this node leads), or
/// the leader's URL. Errors when there is no leader, or when a proxied
/// request reached a non-leader (leadership moved; the client should retry).
pub(super) fn leader_elsewhere(
    s: &AppState,
    headers: &HeaderMap,
) -> Result<Option<String>, ApiError> {
    if s.raft.is_leader() {
        return Ok(None);
    }
    match s.raft.leader() {
        Some((id, _)) if id == s.raft.id() => Ok(None),
        Some(_) if is_forwarded(headers) => Err(ApiError::unavailable(
            "Raft leadership is changing (a proxied request reached a non-leader); retry",
        )),
        Some((_, url)) => Ok(Some(url)),
        None => Err(ApiError::unavailable(
            "no Raft leader (election in progress or no quorum of voters reachable); retry shortly",
        )),
    }
}

/// Proxies a cluster write to the leader and relays its answer as is.
pub(super) async fn forward<T: Serialize>(
    s: &AppState,
    leader_url: &str,
    path: &str,
    body: &T,
    timeout: Duration,
) -> Result<Response, ApiError> {
    let url = format!("{}{path}", leader_url.trim_end_matches('/'));
    tracing::debug!(%url, "forwarding cluster write to the Raft leader");
    let resp = s
        .raft
        .http_client()
        .post(&url)
        .bearer_auth(&*s.token)
        .header(FORWARDED_HEADER, "1")
        .timeout(timeout)
        .json(body)
        .send()
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::BAD_GATEWAY,
                format!(
                    "cannot reach the Raft leader at {leader_url}: {}",
                    join::describe_reqwest(&e)
                ),
            )
        })?;
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let bytes = resp.bytes().await.map_err(|e| {
        ApiError::new(
            StatusCode::BAD_GATEWAY,
            format!(
                "the Raft leader at {leader_url} broke off its answer: {}",
                join::describe_reqwest(&e)
            ),
        )
    })?;
    Ok((status, [(header::CONTENT_TYPE, "application/json")], bytes).into_response())
}

fn raft_error(e: RaftError) -> ApiError {
    ApiError::internal(e.to_string())
}

fn write_status(e: &WriteError) -> StatusCode {
    match e {
        WriteError::ForwardToLeader { .. } | WriteError::NoLeader => {
            StatusCode::SERVICE_UNAVAILABLE
        }
        WriteError::Timeout { .. } => StatusCode::GATEWAY_TIMEOUT,
        WriteError::Membership(_) => StatusCode::CONFLICT,
        WriteError::Fatal(_) => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

pub(super) fn write_error(what: &str, e: WriteError) -> ApiError {
    ApiError::new(write_status(&e), format!("{what}: {e}"))
}

fn join_error(e: JoinError) -> ApiError {
    let status = match &e {
        JoinError::Invalid(_) => StatusCode::BAD_REQUEST,
        JoinError::Unreachable { .. } => StatusCode::BAD_GATEWAY,
        JoinError::Refused(_) => StatusCode::CONFLICT,
        JoinError::StreamsNotReady(_) => StatusCode::GATEWAY_TIMEOUT,
        JoinError::Raft { source, .. } => write_status(source),
    };
    ApiError::new(status, format!("add-node: {e}"))
}
