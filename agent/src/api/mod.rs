//! The agent's HTTP API (axum): Raft RPC, the admin API used by mmctl, and
//! `/metrics`. One listener, one authentication rule: every request carries
//! `Authorization: Bearer <cluster token>`, because Raft RPC can rewrite
//! cluster membership and the admin API can pause replication.

mod admin;
pub mod ops;
mod part;
mod raft_routes;
mod sequences;

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::extract::{DefaultBodyLimit, FromRequest, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use mm_proto::api::ErrorBody;
use serde::de::DeserializeOwned;
use tokio::net::TcpListener;

use crate::join::JoinOptions;
use crate::raft::{self, RaftNode};
use crate::status::StatusRegistry;

/// Header marking a request an agent proxied to the leader, so a stale
/// leader hint can never bounce a request around the cluster.
pub const FORWARDED_HEADER: &str = "x-mm-forwarded";

/// Raft RPC bodies: append batches and 256 KiB snapshot chunks, JSON-encoded.
const RAFT_BODY_LIMIT: usize = 32 * 1024 * 1024;
/// Admin requests are a few small JSON fields.
const ADMIN_BODY_LIMIT: usize = 64 * 1024;

/// Everything the handlers need. Cheap to clone (axum clones it per request).
#[derive(Clone)]
pub struct AppState {
    pub raft: RaftNode,
    /// The shared cluster secret. Never logged, never echoed in a response.
    pub token: Arc<str>,
    pub node_name: String,
    /// This agent's advertised API URL (equal to `raft.api_url()`).
    pub api_url: String,
    /// How peers reach this node's PostgreSQL (holds no password).
    pub peer_dsn: String,
    /// The local PostgreSQL, for `/v1/wal-lsn`.
    pub local_dsn: String,
    pub local_password: Option<String>,
    pub status: Arc<StatusRegistry>,
    /// Timeouts of add-node, and whether it waits for the data plane's streams.
    pub join: JoinOptions,
    /// This node's add-node copy, when it is being added (`GET /v1/sync`).
    pub sync: Arc<crate::sync::Progress>,
    /// The apply gate: `/v1/wal-lsn` sends due compensating deletes, which
    /// run alone like careful transactions (`compensate.rs`).
    pub gate: crate::apply::Gate,
}

/// Serves the API until the listener fails.
pub fn serve(
    listener: TcpListener,
    state: AppState,
) -> impl Future<Output = std::io::Result<()>> + Send {
    let app = router(state);
    async move { axum::serve(listener, app).await }
}

/// Serves the API until `shutdown` completes, then finishes in-flight requests.
pub fn serve_with_shutdown(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> impl Future<Output = std::io::Result<()>> + Send {
    let app = router(state);
    async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
    }
}

/// The complete route table, authentication included.
pub fn router(state: AppState) -> Router {
    let raft_routes = Router::new()
        .route(raft::PATH_APPEND, post(raft_routes::append))
        .route(raft::PATH_VOTE, post(raft_routes::vote))
        .route(raft::PATH_SNAPSHOT, post(raft_routes::snapshot))
        .layer(DefaultBodyLimit::max(RAFT_BODY_LIMIT));
    let admin_routes = Router::new()
        .route("/v1/info", get(admin::info))
        .route("/v1/init", post(admin::init))
        .route("/v1/nodes", post(admin::add_node))
        .route("/v1/pause", post(admin::pause))
        .route("/v1/resume", post(admin::resume))
        .route("/v1/status", get(admin::status))
        .route("/v1/sync", get(admin::sync))
        .route("/v1/wal-lsn", get(admin::wal_lsn))
        .route("/v1/pending", post(admin::pending))
        .route("/v1/nodes/remove", post(part::remove))
        .route("/v1/slots", get(part::slots))
        .route("/v1/sequence-local", post(sequences::local))
        .route("/v1/sequences", get(sequences::list).post(sequences::add))
        .route("/v1/sequences/allocate", post(sequences::allocate))
        .route("/v1/skip", post(ops::skip))
        .route("/v1/conflicts", get(ops::conflicts))
        .route("/v1/cluster/conflicts", get(ops::cluster_conflicts))
        .route("/metrics", get(admin::metrics))
        .layer(DefaultBodyLimit::max(ADMIN_BODY_LIMIT));
    Router::new()
        .merge(raft_routes)
        .merge(admin_routes)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Outermost: nothing, not even a 404, is answered without the token.
        .layer(middleware::from_fn_with_state(state.clone(), require_token))
        .with_state(state)
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "no such endpoint")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method not allowed on this endpoint",
    )
}

async fn require_token(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    // An agent with an empty token accepts nobody (config validation should
    // have refused it; this keeps a misconfiguration from opening the API).
    let ok = match presented {
        Some(p) => {
            !state.token.is_empty() && constant_time_eq(p.as_bytes(), state.token.as_bytes())
        }
        None => false,
    };
    if !ok {
        let mut resp = ApiError::new(
            StatusCode::UNAUTHORIZED,
            "missing or wrong cluster token (expected header Authorization: Bearer <token>)",
        )
        .into_response();
        resp.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return resp;
    }
    next.run(req).await
}

/// Compares without an early exit, so response timing does not reveal how
/// many leading bytes of a guessed token were right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for (i, &x) in b.iter().enumerate() {
        diff |= x ^ a.get(i).copied().unwrap_or(!x);
    }
    diff == 0
}

/// An error answer: `{"error": "<one line>"}` with a status code.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!(status = %self.status, error = %self.message, "API request failed");
        }
        let body = ErrorBody {
            error: self.message,
        };
        (self.status, axum::Json(body)).into_response()
    }
}

/// A JSON request body. Unlike `axum::Json`, every failure (no body, not
/// JSON, wrong or unknown fields) is a 400 with a JSON error, and no
/// Content-Type header is demanded (curl users forget it).
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            ApiError::new(
                e.status(),
                format!("cannot read request body: {}", e.body_text()),
            )
        })?;
        serde_json::from_slice(&bytes)
            .map(ApiJson)
            .map_err(|e| ApiError::bad_request(format!("invalid JSON request: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::constant_time_eq;

    #[test]
    fn token_comparison() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secreT", b"secret"));
        assert!(!constant_time_eq(b"secret-and-more", b"secret"));
        assert!(!constant_time_eq(b"sec", b"secret"));
        assert!(!constant_time_eq(b"", b"secret"));
        assert!(!constant_time_eq(b"\xff", b"\x00"));
    }
}
