//! mmctl's commands. Each returns what to print on success, or a `CtlError`
//! that becomes the single `mmctl: <what failed>: <why>` line.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use mm_proto::Lsn;
use mm_proto::api::{
    ClusterConflictsResponse, ErrorKind, InitResponse, NodeInfo, NodeState, PairRequest,
    PauseResponse, PendingRequest, PendingResponse, SkipRequest, SkipResponse, StatusResponse,
    StreamState, StreamStatus, WalLsnResponse,
};
use serde::Serialize;

use super::client::{AgentClient, ClientError};
use super::output::{ClusterStatus, NodeView, PairView, render_conflicts, render_status};

/// A failed command: printed as `mmctl: {what}: {why}`.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {why}")]
pub struct CtlError {
    pub what: String,
    pub why: String,
}

impl CtlError {
    pub fn new(what: impl Into<String>, why: impl ToString) -> Self {
        Self {
            what: what.into(),
            why: why.to_string(),
        }
    }
}

/// Output of a successful command.
pub struct Output {
    pub human: String,
    pub json: serde_json::Value,
    /// Printed in full, then exit 1 (status with a stream in error).
    pub failed: bool,
}

impl Output {
    pub(super) fn new<T: Serialize>(human: String, json: &T) -> Result<Self, CtlError> {
        let json =
            serde_json::to_value(json).map_err(|e| CtlError::new("encoding JSON output", e))?;
        Ok(Self {
            human,
            json,
            failed: false,
        })
    }
}

pub async fn init(c: &AgentClient, agent: &str) -> Result<Output, CtlError> {
    let r: InitResponse = c
        .post(
            agent,
            "/v1/init",
            &serde_json::json!({}),
            Some(Duration::from_secs(30)),
        )
        .await
        .map_err(|e| CtlError::new("init", e))?;
    Output::new(
        format!(
            "initialized a new cluster: node {} (id {}) at {agent}",
            r.name, r.node_id
        ),
        &r,
    )
}

pub async fn pause(
    c: &AgentClient,
    agent: &str,
    from: &str,
    to: &str,
    paused: bool,
) -> Result<Output, CtlError> {
    let (path, verb) = if paused {
        ("/v1/pause", "pause")
    } else {
        ("/v1/resume", "resume")
    };
    let req = PairRequest {
        from: from.to_owned(),
        to: to.to_owned(),
    };
    let r: PauseResponse = c
        .post(agent, path, &req, Some(Duration::from_secs(45)))
        .await
        .map_err(|e| CtlError::new(format!("{verb} {from} → {to}"), e))?;
    if r.paused {
        wait_stream_paused(c, agent, from, to).await?;
    }
    let human = if r.paused {
        format!(
            "paused {} → {}: {} no longer applies {}'s changes (kept in {}'s slot) until resumed",
            r.from, r.to, r.to, r.from, r.from
        )
    } else {
        format!("resumed {} → {}", r.from, r.to)
    };
    Output::new(human, &r)
}

/// The addressed agent merges every member's conflict log; nodes it could
/// not read are warnings, unless no node could be read at all.
pub async fn conflicts(c: &AgentClient, agent: &str, limit: u32) -> Result<Output, CtlError> {
    let r: ClusterConflictsResponse = c
        .get(agent, &format!("/v1/cluster/conflicts?limit={limit}"))
        .await
        .map_err(|e| CtlError::new("conflicts", e))?;
    if r.nodes.is_empty() && !r.errors.is_empty() {
        let why: Vec<String> = r
            .errors
            .iter()
            .map(|e| format!("{}: {}", e.node, e.error))
            .collect();
        return Err(CtlError::new(
            "conflicts",
            format!("no node's conflict log could be read: {}", why.join("; ")),
        ));
    }
    Output::new(render_conflicts(&r), &r)
}

/// Stores the skip request on the addressed node; its stream from `from`
/// restarts at once and skips the transaction when it reaches it.
pub async fn skip(c: &AgentClient, agent: &str, from: &str, lsn: &str) -> Result<Output, CtlError> {
    let req = SkipRequest {
        from: from.to_owned(),
        lsn: lsn.to_owned(),
    };
    let r: SkipResponse = c
        .post(agent, "/v1/skip", &req, Some(Duration::from_secs(30)))
        .await
        .map_err(|e| CtlError::new(format!("skip {from} {lsn}"), e))?;
    let human = format!(
        "{}: {} will skip {}'s transaction with commit LSN {} (audited in its conflict log as skipped_transaction); its stream from {} restarts now",
        if r.already_requested {
            "already requested"
        } else {
            "requested"
        },
        r.node,
        r.from,
        r.lsn,
        r.from
    );
    Output::new(human, &r)
}

/// A pause is recorded in Raft first; `to`'s reconciler then stops the
/// stream. Return only once `to` reports it stopped, so that a caller who
/// writes on `from` right after `pause` knows the write will be held.
async fn wait_stream_paused(
    c: &AgentClient,
    agent: &str,
    from: &str,
    to: &str,
) -> Result<(), CtlError> {
    let what = || format!("pause {from} → {to}");
    let first: StatusResponse = c
        .get(agent, "/v1/status")
        .await
        .map_err(|e| CtlError::new(what(), e))?;
    let Some(target) = first.nodes.iter().find(|n| n.name == to) else {
        return Ok(());
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(st) = c.get::<StatusResponse>(&target.api_url, "/v1/status").await
            && st
                .streams
                .iter()
                .find(|s| s.from == from)
                .is_none_or(|s| s.state == mm_proto::api::StreamState::Paused)
        {
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            return Err(CtlError::new(
                what(),
                format!("recorded, but {to} has not stopped its stream from {from} within 30 s"),
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Asks `--agent` for the node list, then every node for its own view.
pub async fn status(c: &AgentClient, agent: &str) -> Result<Output, CtlError> {
    let first: StatusResponse = c
        .get(agent, "/v1/status")
        .await
        .map_err(|e| CtlError::new("status", e))?;
    let statuses = fetch_all_statuses(c, &first).await;
    let agg = aggregate(agent, &first, &statuses);
    let mut out = Output::new(render_status(&agg), &agg)?;
    // Documented: status exits 1 when any stream is in error, so scripts
    // and health checks need not parse it.
    out.failed = agg.pairs.iter().any(|p| p.state == "error");
    Ok(out)
}

/// Every node's /v1/status (by node id), reusing `first` for the node that answered it.
async fn fetch_all_statuses(
    c: &AgentClient,
    first: &StatusResponse,
) -> BTreeMap<u64, Result<StatusResponse, String>> {
    let calls = first.nodes.iter().map(|n| async move {
        if n.id == first.node_id {
            return (n.id, Ok(first.clone()));
        }
        let r = c
            .get::<StatusResponse>(&n.api_url, "/v1/status")
            .await
            .map_err(|e| e.to_string());
        (n.id, r)
    });
    join_all(calls).await.into_iter().collect()
}

pub fn aggregate(
    agent: &str,
    first: &StatusResponse,
    statuses: &BTreeMap<u64, Result<StatusResponse, String>>,
) -> ClusterStatus {
    let leader_id = first.leader.as_ref().map(|l| l.id);
    let paused: BTreeSet<(String, String)> = first.paused.iter().cloned().collect();
    let nodes = first
        .nodes
        .iter()
        .map(|n| {
            let st = statuses.get(&n.id);
            let ok = st.and_then(|r| r.as_ref().ok());
            NodeView {
                info: n.clone(),
                is_leader: Some(n.id) == leader_id,
                reachable: ok.is_some(),
                error: st.and_then(|r| r.as_ref().err().cloned()),
                term: ok.map(|s| s.term),
                last_applied_index: ok.map(|s| s.last_applied_index),
                tombstones: ok.and_then(|s| s.tombstones),
            }
        })
        .collect();
    let mut pairs = Vec::new();
    for to in &first.nodes {
        for from in &first.nodes {
            if from.id == to.id {
                continue;
            }
            let is_paused = paused.contains(&(from.name.clone(), to.name.clone()));
            let mut p = PairView {
                from: from.name.clone(),
                to: to.name.clone(),
                state: "unreachable".into(),
                paused: is_paused,
                lag_bytes: None,
                lag_seconds: None,
                applied_txns: None,
                applied_rows: None,
                conflicts_total: None,
                conflicts: BTreeMap::new(),
                routine: None,
                received_lsn: None,
                applied_lsn: None,
                processed_lsn: None,
                restarts: None,
                streamed_bytes: None,
                early_txns: None,
                conflict_rollbacks: None,
                conflicts_in_place: None,
                last_error: None,
                error_kind: None,
                stuck_lsn: None,
                publisher_lsn: None,
            };
            if let Some(Ok(st)) = statuses.get(&to.id) {
                match st.streams.iter().find(|s| s.from == from.name) {
                    None => p.state = "no_stream".into(),
                    Some(s) => {
                        p.state = stream_state_name(s.state);
                        p.lag_bytes = s.lag_bytes;
                        p.lag_seconds = s.lag_seconds;
                        p.applied_txns = Some(s.applied_txns);
                        p.applied_rows = Some(s.applied_rows);
                        p.conflicts_total = Some(s.conflicts.values().sum());
                        p.conflicts = s.conflicts.clone();
                        p.routine = Some(s.routine);
                        p.received_lsn = s.received_lsn;
                        p.applied_lsn = s.applied_lsn;
                        p.processed_lsn = s.processed_lsn;
                        p.restarts = Some(s.restarts);
                        p.streamed_bytes = Some(s.streamed_bytes);
                        p.early_txns = Some(s.early_txns);
                        p.conflict_rollbacks = Some(s.conflict_rollbacks);
                        p.conflicts_in_place = Some(s.conflicts_in_place);
                        p.last_error = s.last_error.clone();
                        p.error_kind = s.error_kind;
                        p.stuck_lsn = s.stuck_lsn;
                        p.publisher_lsn = s.publisher_lsn;
                    }
                }
            }
            pairs.push(p);
        }
    }
    ClusterStatus {
        agent: agent.to_owned(),
        leader: first.leader.clone(),
        term: first.term,
        nodes,
        pairs,
        paused: first.paused.clone(),
        sequences: first.sequences.clone(),
    }
}

fn stream_state_name(s: StreamState) -> String {
    serde_json::to_value(s)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_else(|| format!("{s:?}").to_lowercase())
}

#[derive(Serialize)]
struct WaitSyncResult {
    synced: bool,
    /// Ordered pairs (from, to) that were waited for.
    pairs: usize,
    /// Paused pairs left out (`--ignore-paused`).
    ignored_paused: usize,
    elapsed_seconds: f64,
    /// Each node's WAL position at the start of the barrier.
    barrier: BTreeMap<String, Lsn>,
}

/// The barrier: every node's WAL position is read once; then every node must
/// have processed every other node's stream up to that position.
///
/// It fails at once, instead of waiting out the timeout, for a stream that
/// cannot get there by itself: one stopped by a definite error (its error is
/// printed: peer, relation, LSN, cause) and a paused one with a transaction
/// of the publisher's committed before the barrier still waiting in its slot
/// (with its lag), unless `ignore_paused` leaves paused pairs out. A paused
/// stream with nothing waiting is in sync: the publisher's WAL moves without
/// writes of its own (watermarks, changes it applied from other nodes).
pub async fn wait_sync(
    c: &AgentClient,
    agent: &str,
    timeout: Duration,
    ignore_paused: bool,
) -> Result<Output, CtlError> {
    let started = Instant::now();
    let fail = |why: String| CtlError::new("wait-sync", why);
    let first: StatusResponse = c
        .get(agent, "/v1/status")
        .await
        .map_err(|e| fail(e.to_string()))?;
    let nodes: Vec<NodeInfo> = first
        .nodes
        .iter()
        .filter(|n| n.state != NodeState::Parting)
        .cloned()
        .collect();
    let paused: BTreeSet<(String, String)> = first.paused.iter().cloned().collect();

    // Each node's WAL position, after it sent the compensating deletes
    // that were due (`compensate`), and how many it ever recorded.
    // An agent that cannot be reached (restarting: its process is back
    // before its API listens) is asked again until the timeout; any other
    // answer is final.
    let deadline = started + timeout;
    let take_barrier = || async {
        let lsns = join_all(nodes.iter().map(|n| async move {
            loop {
                let r = c.get::<WalLsnResponse>(&n.api_url, "/v1/wal-lsn").await;
                match r {
                    Err(ClientError::Unreachable { .. }) if Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(200)).await
                    }
                    r => return (n.name.clone(), r),
                }
            }
        }))
        .await;
        let mut barrier = BTreeMap::new();
        let mut recorded = BTreeMap::new();
        let mut waiting = 0;
        for (name, r) in lsns {
            let lsn =
                r.map_err(|e| fail(format!("cannot read node {name}'s WAL position: {e}")))?;
            barrier.insert(name.clone(), lsn.lsn);
            recorded.insert(name, lsn.compensations);
            waiting += lsn.compensations_waiting;
        }
        Ok::<_, CtlError>((barrier, recorded, waiting))
    };
    let (mut barrier, mut recorded, mut waiting) = take_barrier().await?;

    // (from, to) → last known description of why it is behind.
    let mut pending: BTreeMap<(String, String), String> = BTreeMap::new();
    let mut skipped = 0usize;
    for from in &nodes {
        for to in &nodes {
            let key = (from.name.clone(), to.name.clone());
            if from.id == to.id {
                continue;
            }
            if ignore_paused && paused.contains(&key) {
                skipped += 1;
                continue;
            }
            pending.insert(key, "not checked yet".into());
        }
    }
    let total = pending.len();
    let all_pairs: Vec<(String, String)> = pending.keys().cloned().collect();
    let mut rounds = 1;
    loop {
        let targets: Vec<&NodeInfo> = nodes
            .iter()
            .filter(|n| pending.keys().any(|(_, to)| to == &n.name))
            .collect();
        let answers = join_all(targets.iter().map(|n| async move {
            (
                n.name.clone(),
                c.get::<StatusResponse>(&n.api_url, "/v1/status").await,
            )
        }))
        .await;
        // Streams that will not get there by themselves: fail now.
        let mut stuck: Vec<String> = Vec::new();
        for (to, answer) in answers {
            let keys: Vec<(String, String)> =
                pending.keys().filter(|(_, t)| *t == to).cloned().collect();
            for key in keys {
                let target = barrier.get(&key.0).copied().unwrap_or_default();
                let verdict = match &answer {
                    Err(e) => Verdict::Behind(format!("{to} unreachable: {e}")),
                    Ok(st) => {
                        let s = st.streams.iter().find(|s| s.from == key.0);
                        let api_url = targets
                            .iter()
                            .find(|n| n.name == to)
                            .map(|n| n.api_url.as_str())
                            .unwrap_or(agent);
                        judge(c, api_url, &key, s, target, paused.contains(&key)).await
                    }
                };
                match verdict {
                    Verdict::Done => {
                        pending.remove(&key);
                    }
                    Verdict::Behind(why) => {
                        pending.insert(key, why);
                    }
                    Verdict::Stuck(why) => stuck.push(format!("{} → {}: {why}", key.0, key.1)),
                }
            }
        }
        if !stuck.is_empty() {
            return Err(fail(format!(
                "{} stream(s) cannot catch up by themselves:\n{}",
                stuck.len(),
                stuck.join("\n")
            )));
        }
        if pending.is_empty() {
            // Applying up to the barrier may have given rows up on unique
            // values somewhere: their compensating deletes were sent after
            // it. In sync only when a round added none on any node.
            let (next, now_recorded, now_waiting) = take_barrier().await?;
            if now_recorded != recorded || waiting > 0 || now_waiting > 0 {
                barrier = next;
                recorded = now_recorded;
                waiting = now_waiting;
                rounds += 1;
                let why = if now_waiting > 0 {
                    format!(
                        "{now_waiting} compensating delete(s) not sent yet (not due yet, or \
                         held up by a user's transaction)"
                    )
                } else {
                    "compensating deletes sent since the barrier".to_owned()
                };
                for k in &all_pairs {
                    pending.insert(k.clone(), why.clone());
                }
                if Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            }
        }
        if pending.is_empty() {
            let elapsed = started.elapsed().as_secs_f64();
            tracing::debug!(rounds, "wait-sync rounds");
            let res = WaitSyncResult {
                synced: true,
                pairs: total,
                ignored_paused: skipped,
                elapsed_seconds: elapsed,
                barrier,
            };
            let note = if skipped > 0 {
                format!(" ({skipped} paused left out)")
            } else {
                String::new()
            };
            return Output::new(
                format!(
                    "in sync: {total} streams caught up with the barrier in {elapsed:.1}s{note}"
                ),
                &res,
            );
        }
        if Instant::now() >= deadline {
            let behind: Vec<String> = pending
                .iter()
                .map(|((from, to), why)| format!("{from} → {to} ({why})"))
                .collect();
            return Err(fail(format!(
                "timed out after {}s; still behind: {}",
                timeout.as_secs(),
                behind.join(", ")
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

enum Verdict {
    Done,
    /// Still moving (or not yet known): keep waiting.
    Behind(String),
    /// Will not move by itself: fail at once.
    Stuck(String),
}

/// One pair against the barrier `target` (the publisher's WAL position at
/// the start).
async fn judge(
    c: &AgentClient,
    to_api: &str,
    (from, _): &(String, String),
    s: Option<&StreamStatus>,
    target: Lsn,
    paused: bool,
) -> Verdict {
    let processed = s.and_then(|s| s.processed_lsn);
    if processed.is_some_and(|p| p >= target) {
        return Verdict::Done;
    }
    let lag = s.map(lag_text).unwrap_or_default();
    if paused {
        // Only a transaction waiting in the slot makes it behind.
        let req = PendingRequest {
            from: from.clone(),
            upto: target,
        };
        return match c
            .post::<_, PendingResponse>(to_api, "/v1/pending", &req, None)
            .await
        {
            Ok(PendingResponse {
                first_commit_ts: None,
            }) => Verdict::Done,
            Ok(PendingResponse {
                first_commit_ts: Some(ts),
            }) => Verdict::Stuck(format!(
                "paused with changes waiting (first committed {}; {}); resume it, or pass --ignore-paused",
                ts.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
                paused_lag(s, target, ts, chrono::Utc::now())
            )),
            Err(e) => Verdict::Behind(format!("paused; cannot tell what waits: {e}")),
        };
    }
    let Some(s) = s else {
        return Verdict::Behind("no stream".into());
    };
    if s.state == StreamState::Error && s.error_kind == Some(ErrorKind::Definite) {
        return Verdict::Stuck(format!(
            "error ({lag}): {}",
            s.last_error.as_deref().unwrap_or("(no message)")
        ));
    }
    match processed {
        Some(p) => Verdict::Behind(format!("processed {p} of {target}")),
        None => Verdict::Behind(format!("nothing processed yet, need {target}")),
    }
}

/// A paused stream's lag as of now: the barrier (the publisher's WAL
/// position when wait-sync started) minus what was applied, and the age of
/// the first change waiting. The agent's own figures come from a probe that
/// runs once a second, so right after writes they still read 0.
fn paused_lag(
    s: Option<&StreamStatus>,
    target: Lsn,
    first_waiting: chrono::DateTime<chrono::Utc>,
    now: chrono::DateTime<chrono::Utc>,
) -> String {
    let secs = (now - first_waiting).num_milliseconds().max(0) as f64 / 1000.0;
    match s.and_then(|s| s.applied_lsn) {
        Some(a) => format!("lag {} bytes, {secs:.1} s", target.0.saturating_sub(a.0)),
        None => format!("lag {secs:.1} s"),
    }
}

fn lag_text(s: &StreamStatus) -> String {
    match (s.lag_bytes, s.lag_seconds) {
        (Some(b), Some(t)) => format!("lag {b} bytes, {t:.1} s"),
        (Some(b), None) => format!("lag {b} bytes"),
        _ => "lag unknown".into(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;
    use mm_proto::api::{LeaderInfo, Members, StreamStatus};

    #[test]
    fn a_paused_streams_lag_is_measured_against_the_barrier_and_the_first_waiting_change() {
        let now = chrono::Utc::now();
        // The probe's figures are stale (0): not used.
        let mut status = stream("a", "b");
        status.applied_lsn = Some(Lsn(1000));
        status.lag_bytes = Some(0);
        status.lag_seconds = Some(0.0);
        assert_eq!(
            paused_lag(
                Some(&status),
                Lsn(1500),
                now - chrono::Duration::milliseconds(2500),
                now
            ),
            "lag 500 bytes, 2.5 s"
        );
        assert_eq!(paused_lag(None, Lsn(1500), now, now), "lag 0.0 s");
    }

    fn node(id: u64, name: &str) -> NodeInfo {
        NodeInfo {
            id,
            name: name.into(),
            api_url: format!("http://127.0.0.1:{id}"),
            peer_dsn: String::new(),
            state: NodeState::Active,
        }
    }

    /// Built through the registry so new StreamStatus fields need no edit here.
    fn stream(from: &str, to: &str) -> StreamStatus {
        let reg = crate::status::StatusRegistry::new(to);
        reg.update(from, |s| {
            s.state = StreamState::Streaming;
            s.processed_lsn = Some(Lsn(10));
            s.lag_bytes = Some(5);
            s.lag_seconds = Some(0.5);
            s.applied_txns = 7;
            s.applied_rows = 9;
            s.conflicts =
                BTreeMap::from([("insert_exists".into(), 2), ("delete_missing".into(), 1)]);
            s.routine = 13;
        });
        reg.get(from).unwrap()
    }

    fn status_of(id: u64, name: &str, streams: Vec<StreamStatus>) -> StatusResponse {
        StatusResponse {
            node: name.into(),
            node_id: id,
            leader: Some(LeaderInfo {
                id: 1,
                name: Some("n1".into()),
                url: "http://127.0.0.1:1".into(),
            }),
            term: 4,
            last_applied_index: 12,
            members: Members::default(),
            nodes: vec![node(1, "n1"), node(2, "n2"), node(3, "n3")],
            paused: vec![("n2".into(), "n1".into())],
            streams,
            tombstones: Some(id * 10),
            sequences: Vec::new(),
        }
    }

    #[test]
    fn aggregate_covers_every_ordered_pair_and_marks_unreachable() {
        let first = status_of(1, "n1", vec![stream("n2", "n1")]);
        let mut all = BTreeMap::new();
        all.insert(1, Ok(first.clone()));
        all.insert(
            2,
            Ok(status_of(
                2,
                "n2",
                vec![stream("n1", "n2"), stream("n3", "n2")],
            )),
        );
        all.insert(
            3,
            Err("cannot reach the agent: connection refused".to_string()),
        );
        let agg = aggregate("http://127.0.0.1:1", &first, &all);
        assert_eq!(agg.pairs.len(), 6);
        let pair = |f: &str, t: &str| agg.pairs.iter().find(|p| p.from == f && p.to == t).unwrap();
        assert_eq!(pair("n2", "n1").state, "streaming");
        assert!(pair("n2", "n1").paused);
        assert_eq!(pair("n2", "n1").conflicts_total, Some(3));
        assert_eq!(pair("n3", "n1").state, "no_stream");
        assert_eq!(pair("n1", "n3").state, "unreachable");
        assert_eq!(pair("n1", "n2").applied_txns, Some(7));
        assert_eq!(pair("n1", "n2").routine, Some(13));
        assert_eq!(pair("n1", "n3").routine, None);
        assert_eq!(pair("n2", "n1").conflicts.get("insert_exists"), Some(&2));
        let n3 = agg.nodes.iter().find(|n| n.info.name == "n3").unwrap();
        assert!(!n3.reachable);
        assert!(n3.error.as_deref().unwrap().contains("connection refused"));
        assert_eq!(n3.tombstones, None);
        let n2 = agg.nodes.iter().find(|n| n.info.name == "n2").unwrap();
        assert_eq!(n2.tombstones, Some(20));
        assert!(
            agg.nodes
                .iter()
                .find(|n| n.info.name == "n1")
                .unwrap()
                .is_leader
        );
        let text = render_status(&agg);
        assert!(text.contains("n1 → n3"), "{text}");
        assert!(text.contains("unreachable"), "{text}");
        assert!(text.contains("term 4"), "{text}");
        let by_type = text.lines().find(|l| l.contains("delete_missing")).unwrap();
        assert!(
            by_type.contains("n2 → n1") && by_type.ends_with("delete_missing 1, insert_exists 2"),
            "{text}"
        );
        let n2_line = text.lines().find(|l| l.contains(" n2 ")).unwrap();
        assert!(n2_line.contains(" 20 "), "tombstones: {text}");
    }
}
