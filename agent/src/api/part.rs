//! `POST /v1/nodes/remove` and `GET /v1/slots` (remove-node, `part.rs`).

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use mm_proto::api::{RemoveNodeRequest, SlotsResponse};

use super::admin::{forward, is_forwarded, leader_elsewhere, write_error};
use super::{ApiError, ApiJson, AppState};
use crate::part::PartError;
use crate::raft::WriteError;

/// Parting takes three Raft writes and a short wait for the node.
const REMOVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

pub(super) async fn remove(
    State(s): State<AppState>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<RemoveNodeRequest>,
) -> Result<Response, ApiError> {
    if let Some(url) = leader_elsewhere(&s, &headers)? {
        return forward(&s, &url, "/v1/nodes/remove", &req, REMOVE_TIMEOUT).await;
    }
    match crate::part::remove_node(&s.raft, &req.name).await {
        Ok(node) => Ok(Json(node).into_response()),
        Err(PartError::Unknown(n)) => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("unknown node {n}"),
        )),
        Err(PartError::Rejected(e)) => Err(ApiError::new(StatusCode::CONFLICT, e)),
        Err(PartError::Raft {
            source: WriteError::ForwardToLeader { leader_url, .. },
            ..
        }) if !is_forwarded(&headers) => {
            forward(&s, &leader_url, "/v1/nodes/remove", &req, REMOVE_TIMEOUT).await
        }
        Err(PartError::Raft { what, source }) => Err(write_error(&what, source)),
    }
}

/// One text column of every row of `sql`.
async fn names(client: &tokio_postgres::Client, sql: &str) -> Result<Vec<String>, ApiError> {
    let pg = |e: tokio_postgres::Error| ApiError::unavailable(format!("local PostgreSQL: {e}"));
    client
        .query(sql, &[])
        .await
        .map_err(pg)?
        .iter()
        .map(|r| r.try_get(0))
        .collect::<Result<Vec<String>, _>>()
        .map_err(pg)
}

pub(super) async fn slots(State(s): State<AppState>) -> Result<Json<SlotsResponse>, ApiError> {
    let client = crate::pg::connect(&s.local_dsn, s.local_password.as_deref())
        .await
        .map_err(|e| ApiError::unavailable(format!("local PostgreSQL: {e}")))?;
    let slots = names(
        &client,
        "SELECT slot_name::text FROM pg_catalog.pg_replication_slots WHERE slot_name LIKE 'mm\\_%' ORDER BY 1",
    )
    .await?;
    let origins = names(
        &client,
        "SELECT roname::text FROM pg_catalog.pg_replication_origin WHERE roname LIKE 'mm\\_%' ORDER BY 1",
    )
    .await?;
    Ok(Json(SlotsResponse {
        node: s.node_name.clone(),
        slots,
        origins,
    }))
}
