//! Raft RPC endpoints. The bodies are opaque here: `raft::RaftNode::handle_rpc`
//! owns the wire format, so openraft's types never leak into the API layer.

use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;

use super::{ApiError, AppState};
use crate::raft::{RpcKind, RpcServeError};

pub(super) async fn append(
    State(s): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    rpc(&s, RpcKind::Append, body).await
}

pub(super) async fn vote(
    State(s): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    rpc(&s, RpcKind::Vote, body).await
}

pub(super) async fn snapshot(
    State(s): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    rpc(&s, RpcKind::Snapshot, body).await
}

async fn rpc(s: &AppState, kind: RpcKind, body: Result<Bytes, BytesRejection>) -> Response {
    let body = match body {
        Ok(b) => b,
        Err(e) => {
            return ApiError::new(
                e.status(),
                format!("cannot read Raft RPC body: {}", e.body_text()),
            )
            .into_response();
        }
    };
    match s.raft.handle_rpc(kind, &body).await {
        Ok(json) => ([(header::CONTENT_TYPE, "application/json")], json).into_response(),
        Err(e @ RpcServeError::BadRequest(_)) => {
            ApiError::bad_request(e.to_string()).into_response()
        }
        Err(e @ RpcServeError::Encode(_)) => ApiError::internal(e.to_string()).into_response(),
    }
}
