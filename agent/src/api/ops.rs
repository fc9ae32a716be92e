//! Conflict operations: `POST /v1/skip` (store a skip request on this node
//! and restart the stuck stream) and the conflict log, this node's own
//! (`GET /v1/conflicts`) or every member's merged (`GET /v1/cluster/conflicts`).
//!
//! Both read and write only the LOCAL PostgreSQL: a skip is a repair of one
//! node's stream, and each node's conflict log records what that node resolved.

use std::time::Duration;

use axum::Json;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use futures_util::future::join_all;
use mm_proto::Lsn;
use mm_proto::api::{
    ClusterConflictsResponse, ConflictRecord, ConflictsResponse, NodeError, SkipRequest,
    SkipResponse,
};
use tokio_postgres::error::SqlState;

use super::{ApiError, ApiJson, AppState};
use crate::join::describe_reqwest;

/// Rows returned when the caller gives no `limit`.
pub const DEFAULT_CONFLICT_LIMIT: u32 = 20;
/// Upper bound of `limit`: a diagnostic view, not an export.
pub const MAX_CONFLICT_LIMIT: u32 = 10_000;
/// One peer's conflict log; a node slower than this is reported, not waited for.
const PEER_TIMEOUT: Duration = Duration::from_secs(5);
/// The local PostgreSQL, connection and query together.
const LOCAL_TIMEOUT: Duration = Duration::from_secs(10);

/// `POST /v1/skip`: validates, stores `(from, lsn)` in `mm.skip_requests`,
/// then kicks the stream from `from` so it restarts now and reads it.
pub(super) async fn skip(
    State(s): State<AppState>,
    ApiJson(req): ApiJson<SkipRequest>,
) -> Result<Json<SkipResponse>, ApiError> {
    let from = req.from.trim();
    if from.is_empty() {
        return Err(ApiError::bad_request(
            "--from is empty: name the node whose transaction is stuck",
        ));
    }
    let lsn: Lsn = req
        .lsn
        .parse()
        .map_err(|e| ApiError::bad_request(format!("{e}")))?;
    if lsn.is_invalid() {
        return Err(ApiError::bad_request(
            "invalid LSN 0/0: give the stuck transaction's commit LSN, shown in the stream's last error",
        ));
    }
    if from == s.node_name {
        return Err(ApiError::bad_request(format!(
            "--from {from} is this node: --from names the node whose transaction is stuck, --agent the node where it is stuck"
        )));
    }
    let known =
        s.status.get(from).is_some() || s.raft.cluster().borrow().node_by_name(from).is_some();
    if !known {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "unknown node {from}: not a cluster member and no stream from it into {}",
                s.node_name
            ),
        ));
    }
    // Only the transaction the stream is stopped at can be skipped: a
    // request for any other LSN would wait invisibly and skip whatever
    // later commits there.
    let stream = s.status.get(from);
    let stuck = stream.as_ref().and_then(|st| st.stuck_lsn);
    if stuck != Some(lsn) {
        let now = match (&stream, stuck) {
            (_, Some(l)) => format!("it is stopped at the transaction with commit LSN {l}"),
            (Some(st), None) => format!(
                "it is {}, not stopped at a transaction",
                serde_json::to_value(st.state)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_default()
            ),
            (None, None) => "it is not running here".to_owned(),
        };
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            format!(
                "the stream from {from} into {} is not stopped at {lsn} ({now}); nothing to skip (mmctl status shows a stuck transaction's commit LSN)",
                s.node_name
            ),
        ));
    }
    let already_requested = tokio::time::timeout(LOCAL_TIMEOUT, store_skip(&s, from, lsn))
        .await
        .map_err(|_| {
            ApiError::unavailable(format!(
                "local PostgreSQL did not answer within {}s",
                LOCAL_TIMEOUT.as_secs()
            ))
        })??;
    s.status.kick(from);
    // It restarts now: a wait-sync right after the skip must not see the
    // error it is about to leave behind.
    s.status.update(from, |st| {
        if st.state == mm_proto::api::StreamState::Error {
            st.state = mm_proto::api::StreamState::Starting;
        }
    });
    tracing::info!(from, %lsn, already_requested, "skip requested");
    Ok(Json(SkipResponse {
        node: s.node_name.clone(),
        from: from.to_owned(),
        lsn,
        already_requested,
    }))
}

/// Inserts the request; true when it was already there.
async fn store_skip(s: &AppState, from: &str, lsn: Lsn) -> Result<bool, ApiError> {
    let client = crate::pg::connect(&s.local_dsn, s.local_password.as_deref())
        .await
        .map_err(|e| ApiError::unavailable(format!("local PostgreSQL: {e}")))?;
    let inserted = client
        .execute(
            "INSERT INTO mm.skip_requests (from_node, commit_lsn) VALUES ($1, $2::text::pg_lsn) \
             ON CONFLICT (from_node, commit_lsn) DO NOTHING",
            &[&from, &lsn.to_string()],
        )
        .await
        .map_err(|e| pg_error("mm.skip_requests", &e))?;
    Ok(inserted == 0)
}

/// `GET /v1/conflicts?limit=K`: this node's newest conflict-log rows.
pub(super) async fn conflicts(
    State(s): State<AppState>,
    RawQuery(query): RawQuery,
) -> Result<Json<ConflictsResponse>, ApiError> {
    let limit = parse_limit(query.as_deref())?;
    let conflicts = read_local(&s, limit).await?;
    Ok(Json(ConflictsResponse {
        node: s.node_name.clone(),
        conflicts,
    }))
}

/// `GET /v1/cluster/conflicts?limit=K`: every member's log (this node's read
/// directly, the others' through their `/v1/conflicts`), merged newest first.
/// A node that cannot be read is listed in `errors`, never fails the call.
pub(super) async fn cluster_conflicts(
    State(s): State<AppState>,
    RawQuery(query): RawQuery,
) -> Result<Json<ClusterConflictsResponse>, ApiError> {
    let limit = parse_limit(query.as_deref())?;
    let mut members: Vec<(String, String)> = s
        .raft
        .cluster()
        .borrow()
        .nodes
        .values()
        .map(|n| (n.name.clone(), n.api_url.clone()))
        .collect();
    if !members.iter().any(|(name, _)| *name == s.node_name) {
        // Not (yet) in the cluster state: still show this node's own log.
        members.push((s.node_name.clone(), s.api_url.clone()));
    }
    let s_ref = &s;
    let answers = join_all(members.into_iter().map(|(name, url)| async move {
        let r = if name == s_ref.node_name {
            read_local(s_ref, limit).await.map_err(|e| e.message)
        } else {
            read_peer(s_ref, &url, limit).await
        };
        (name, url, r)
    }))
    .await;
    let mut out = ClusterConflictsResponse {
        limit,
        nodes: Vec::new(),
        conflicts: Vec::new(),
        errors: Vec::new(),
    };
    for (node, api_url, r) in answers {
        match r {
            Ok(rows) => {
                out.nodes.push(node);
                out.conflicts.extend(rows);
            }
            Err(error) => out.errors.push(NodeError {
                node,
                api_url,
                error,
            }),
        }
    }
    merge_newest_first(&mut out.conflicts, limit);
    out.nodes.sort();
    out.errors.sort_by(|a, b| a.node.cmp(&b.node));
    Ok(Json(out))
}

/// Newest first by `at` (same-format UTC text, so it sorts as text), then
/// node and id for a stable order; at most `limit` rows.
pub fn merge_newest_first(rows: &mut Vec<ConflictRecord>, limit: u32) {
    rows.sort_by(|a, b| {
        b.at.cmp(&a.at)
            .then_with(|| a.node.cmp(&b.node))
            .then_with(|| b.id.cmp(&a.id))
    });
    rows.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
}

async fn read_peer(s: &AppState, api_url: &str, limit: u32) -> Result<Vec<ConflictRecord>, String> {
    let url = format!(
        "{}/v1/conflicts?limit={limit}",
        api_url.trim_end_matches('/')
    );
    let resp = s
        .raft
        .http_client()
        .get(&url)
        .bearer_auth(&*s.token)
        .timeout(PEER_TIMEOUT)
        .send()
        .await
        .map_err(|e| format!("cannot reach {api_url}: {}", describe_reqwest(&e)))?;
    let status = resp.status();
    let body = resp
        .bytes()
        .await
        .map_err(|e| format!("{api_url} broke off its answer: {}", describe_reqwest(&e)))?;
    if !status.is_success() {
        let msg = serde_json::from_slice::<mm_proto::api::ErrorBody>(&body)
            .map(|b| b.error)
            .unwrap_or_else(|_| String::from_utf8_lossy(&body).chars().take(200).collect());
        return Err(format!("HTTP {} from {api_url}: {msg}", status.as_u16()));
    }
    let r: ConflictsResponse =
        serde_json::from_slice(&body).map_err(|e| format!("unexpected answer from {url}: {e}"))?;
    Ok(r.conflicts)
}

async fn read_local(s: &AppState, limit: u32) -> Result<Vec<ConflictRecord>, ApiError> {
    tokio::time::timeout(LOCAL_TIMEOUT, read_local_inner(s, limit))
        .await
        .map_err(|_| {
            ApiError::unavailable(format!(
                "local PostgreSQL did not answer within {}s",
                LOCAL_TIMEOUT.as_secs()
            ))
        })?
}

/// UTC with microseconds; equal-width text that sorts chronologically.
const TS: &str = r#"'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'"#;

async fn read_local_inner(s: &AppState, limit: u32) -> Result<Vec<ConflictRecord>, ApiError> {
    let client = crate::pg::connect(&s.local_dsn, s.local_password.as_deref())
        .await
        .map_err(|e| ApiError::unavailable(format!("local PostgreSQL: {e}")))?;
    let sql = format!(
        "SELECT id, to_char(at AT TIME ZONE 'UTC', {TS}), relation, conflict_type, key, \
                local_origin, to_char(local_commit_ts AT TIME ZONE 'UTC', {TS}), \
                remote_origin, to_char(remote_commit_ts AT TIME ZONE 'UTC', {TS}), \
                remote_lsn::text, resolution, local_tuple, remote_tuple \
           FROM mm.conflict_log ORDER BY id DESC LIMIT $1"
    );
    let rows = client
        .query(&sql, &[&i64::from(limit)])
        .await
        .map_err(|e| pg_error("mm.conflict_log", &e))?;
    let mut out = Vec::with_capacity(rows.len());
    for r in rows {
        let decode = |e: tokio_postgres::Error| {
            ApiError::internal(format!("mm.conflict_log: unexpected column type: {e}"))
        };
        let lsn: Option<String> = r.try_get(9).map_err(decode)?;
        let remote_lsn = match lsn {
            Some(t) => Some(
                t.parse::<Lsn>()
                    .map_err(|e| ApiError::internal(format!("mm.conflict_log: remote_lsn: {e}")))?,
            ),
            None => None,
        };
        out.push(ConflictRecord {
            node: s.node_name.clone(),
            id: r.try_get(0).map_err(decode)?,
            at: r.try_get(1).map_err(decode)?,
            relation: r.try_get(2).map_err(decode)?,
            conflict_type: r.try_get(3).map_err(decode)?,
            key: r.try_get(4).map_err(decode)?,
            local_origin: r.try_get(5).map_err(decode)?,
            local_commit_ts: r.try_get(6).map_err(decode)?,
            remote_origin: r.try_get(7).map_err(decode)?,
            remote_commit_ts: r.try_get(8).map_err(decode)?,
            remote_lsn,
            resolution: r.try_get(10).map_err(decode)?,
            local_tuple: r.try_get(11).map_err(decode)?,
            remote_tuple: r.try_get(12).map_err(decode)?,
        });
    }
    Ok(out)
}

/// `limit=K` (1..=MAX_CONFLICT_LIMIT) is the only parameter.
fn parse_limit(query: Option<&str>) -> Result<u32, ApiError> {
    let mut limit = DEFAULT_CONFLICT_LIMIT;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if k != "limit" {
            return Err(ApiError::bad_request(format!(
                "unknown query parameter {k:?} (only limit is accepted)"
            )));
        }
        limit = match v.parse::<u32>() {
            Ok(n) if (1..=MAX_CONFLICT_LIMIT).contains(&n) => n,
            _ => {
                return Err(ApiError::bad_request(format!(
                    "invalid limit {v:?}: expected a whole number from 1 to {MAX_CONFLICT_LIMIT}"
                )));
            }
        };
    }
    Ok(limit)
}

fn pg_error(table: &str, e: &tokio_postgres::Error) -> ApiError {
    match e.as_db_error() {
        Some(db) if *db.code() == SqlState::UNDEFINED_TABLE => ApiError::unavailable(format!(
            "{table} does not exist on the local PostgreSQL (the agent creates it at start; is this agent's schema up to date?)"
        )),
        Some(db) => ApiError::unavailable(format!("local PostgreSQL: {table}: {}", db.message())),
        None => ApiError::unavailable(format!("local PostgreSQL: {table}: {e}")),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;

    fn rec(node: &str, id: i64, at: &str) -> ConflictRecord {
        ConflictRecord {
            node: node.into(),
            id,
            at: at.into(),
            relation: "public.t".into(),
            conflict_type: "insert_exists".into(),
            key: None,
            local_origin: None,
            local_commit_ts: None,
            remote_origin: None,
            remote_commit_ts: None,
            remote_lsn: None,
            resolution: "apply_remote".into(),
            local_tuple: None,
            remote_tuple: None,
        }
    }

    #[test]
    fn merge_orders_by_time_across_nodes_and_limits() {
        let mut rows = vec![
            rec("n1", 7, "2026-01-01T00:00:01.000000Z"),
            rec("n1", 6, "2026-01-01T00:00:00.500000Z"),
            rec("n2", 3, "2026-01-01T00:00:02.000000Z"),
            rec("n2", 2, "2026-01-01T00:00:00.100000Z"),
            rec("n3", 9, "2026-01-01T00:00:01.000000Z"),
        ];
        merge_newest_first(&mut rows, 4);
        let got: Vec<(&str, i64)> = rows.iter().map(|r| (r.node.as_str(), r.id)).collect();
        assert_eq!(got, [("n2", 3), ("n1", 7), ("n3", 9), ("n1", 6)]);
    }

    #[test]
    fn limit_parsing() {
        assert_eq!(parse_limit(None).unwrap(), DEFAULT_CONFLICT_LIMIT);
        assert_eq!(parse_limit(Some("")).unwrap(), DEFAULT_CONFLICT_LIMIT);
        assert_eq!(parse_limit(Some("limit=5")).unwrap(), 5);
        for bad in [
            "limit=0",
            "limit=-1",
            "limit=x",
            "limit=",
            "limit=10001",
            "lim=3",
        ] {
            let e = parse_limit(Some(bad)).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{bad}");
        }
    }
}
