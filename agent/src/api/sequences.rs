//! Global sequence endpoints: `mmctl sequence add` asks every node what its
//! copy has handed out (`/v1/sequence-local`), then makes it global
//! (`/v1/sequences`); agents refill through `/v1/sequences/allocate`;
//! `mmctl sequence list` reads `GET /v1/sequences` from every node. Writes
//! go to the Raft leader (forwarded).

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use mm_proto::api::{
    SequenceAddRequest, SequenceAllocateRequest, SequenceInfo, SequenceLocalRequest,
    SequenceLocalResponse, SequenceRangeInfo, SequencesResponse,
};

use super::admin::{FORWARD_TIMEOUT, forward, is_forwarded, leader_elsewhere, write_error};
use super::{ApiError, ApiJson, AppState};
use crate::raft::{ClusterRequest, ClusterResponse, WriteError};
use crate::sequences::{self, LocalSequence};

async fn local_client(s: &AppState) -> Result<tokio_postgres::Client, ApiError> {
    crate::pg::connect(&s.local_dsn, s.local_password.as_deref())
        .await
        .map_err(|e| ApiError::unavailable(format!("local PostgreSQL: {e}")))
}

fn qualified_or_400(name: &str) -> Result<(), ApiError> {
    sequences::split_name(name).map(|_| ()).ok_or_else(|| {
        ApiError::bad_request(format!(
            "sequence {name:?} must be schema-qualified (schema.name)"
        ))
    })
}

pub(super) async fn local(
    State(s): State<AppState>,
    ApiJson(req): ApiJson<SequenceLocalRequest>,
) -> Result<Json<SequenceLocalResponse>, ApiError> {
    qualified_or_400(&req.name)?;
    let client = local_client(&s).await?;
    let pg = |e: tokio_postgres::Error| ApiError::unavailable(format!("local PostgreSQL: {e}"));
    let Some(l) = sequences::read_local(&client, &req.name)
        .await
        .map_err(pg)?
    else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "sequence {} does not exist on node {}",
                req.name, s.node_name
            ),
        ));
    };
    let owner = sequences::owner_max(&client, &req.name).await.map_err(pg)?;
    Ok(Json(SequenceLocalResponse {
        used_max: l.last_value.max(owner),
        min_value: l.min_value,
        max_value: l.max_value,
        increment: l.increment,
    }))
}

/// One Raft write, forwarded to the leader when this node is not it.
async fn write(
    s: &AppState,
    headers: &HeaderMap,
    path: &str,
    what: &str,
    body: &impl serde::Serialize,
    cmd: ClusterRequest,
) -> Result<Response, ApiError> {
    if let Some(url) = leader_elsewhere(s, headers)? {
        return forward(s, &url, path, body, FORWARD_TIMEOUT).await;
    }
    match s.raft.write(cmd).await {
        Ok(ClusterResponse::Ok) => Ok(Json(serde_json::json!({"ok": true})).into_response()),
        Ok(ClusterResponse::Error(e)) => Err(ApiError::new(StatusCode::CONFLICT, e)),
        Err(WriteError::ForwardToLeader { leader_url, .. }) if !is_forwarded(headers) => {
            forward(s, &leader_url, path, body, FORWARD_TIMEOUT).await
        }
        Err(e) => Err(write_error(what, e)),
    }
}

pub(super) async fn add(
    State(s): State<AppState>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<SequenceAddRequest>,
) -> Result<Response, ApiError> {
    qualified_or_400(&req.name)?;
    let cmd = ClusterRequest::AddSequence {
        name: req.name.clone(),
        chunk: req.chunk,
        start: req.start,
        max: req.max,
    };
    let r = write(&s, &headers, "/v1/sequences", "sequence add", &req, cmd).await;
    if r.is_ok() {
        tracing::info!(sequence = %req.name, chunk = req.chunk, start = req.start, "sequence made cluster-global");
    }
    r
}

pub(super) async fn allocate(
    State(s): State<AppState>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<SequenceAllocateRequest>,
) -> Result<Response, ApiError> {
    let cmd = ClusterRequest::AllocateRange {
        sequence: req.sequence.clone(),
        node: req.node.clone(),
        known: req.known,
    };
    write(
        &s,
        &headers,
        "/v1/sequences/allocate",
        "sequence chunk",
        &req,
        cmd,
    )
    .await
}

pub(super) async fn list(State(s): State<AppState>) -> Result<Json<SequencesResponse>, ApiError> {
    let state = s.raft.cluster().borrow().clone();
    let client = if state.sequences.is_empty() {
        None
    } else {
        Some(local_client(&s).await?)
    };
    let mut out = Vec::new();
    for (name, g) in &state.sequences {
        let local: Option<LocalSequence> = match &client {
            Some(c) => sequences::read_local(c, name)
                .await
                .map_err(|e| ApiError::unavailable(format!("local PostgreSQL: {e}")))?,
            None => None,
        };
        let current = local
            .as_ref()
            .and_then(|l| sequences::current(g, &s.node_name, l))
            .map(range_info);
        out.push(SequenceInfo {
            name: name.clone(),
            chunk: g.chunk,
            next: g.next,
            max: g.max,
            exhausted: g.exhausted,
            ranges: g.ranges.iter().map(range_info).collect(),
            last_value: local.and_then(|l| l.last_value),
            current,
        });
    }
    Ok(Json(SequencesResponse {
        node: s.node_name.clone(),
        sequences: out,
    }))
}

fn range_info(r: &crate::raft::types::SequenceRange) -> SequenceRangeInfo {
    SequenceRangeInfo {
        node: r.node.clone(),
        start: r.start,
        end: r.end,
    }
}
