//! The harness itself against real PostgreSQL: settings, identity, crash
//! durability, authentication, cleanup.

#![allow(clippy::unwrap_used)] // tests may unwrap (project rule)

use std::path::PathBuf;
use std::time::{Duration, Instant};

use mm_tests::{Auth, PgNode, PgOptions, effective_uid, process_uid};

fn start_timed(name: &str) -> (PgNode, Duration) {
    let t = Instant::now();
    let node = PgNode::start(name).unwrap();
    (node, t.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_start_concurrently_and_are_configured_for_logical_replication() {
    mm_tests::init_tracing();
    let a = tokio::task::spawn_blocking(|| start_timed("a"));
    let b = tokio::task::spawn_blocking(|| start_timed("b"));
    let ((a, ta), (b, tb)) = (a.await.unwrap(), b.await.unwrap());
    println!("node start times (concurrent): a {ta:?}, b {tb:?}");
    assert_ne!(a.port(), b.port());
    assert_ne!(a.data_dir(), b.data_dir());

    for node in [&a, &b] {
        let setting = |name: &'static str| async move {
            node.query_one_string(&format!("SHOW {name}"))
                .await
                .unwrap()
        };
        assert_eq!(setting("wal_level").await.as_deref(), Some("logical"));
        assert_eq!(
            setting("track_commit_timestamp").await.as_deref(),
            Some("on")
        );
        assert_eq!(
            setting("max_replication_slots").await.as_deref(),
            Some("20")
        );
        assert_eq!(setting("max_wal_senders").await.as_deref(), Some("20"));
        assert_eq!(setting("fsync").await.as_deref(), Some("on"));
        assert_eq!(
            setting("listen_addresses").await.as_deref(),
            Some("127.0.0.1")
        );
        assert_eq!(setting("port").await, Some(node.port().to_string()));
        assert_eq!(
            node.query_one_string("SELECT current_user")
                .await
                .unwrap()
                .as_deref(),
            Some("postgres")
        );
        assert!(node.dsn().contains(&format!("port={}", node.port())));
        assert!(!node.dsn().contains("password"));
    }

    // Each node has its own data: same table, different rows.
    a.execute(
        "CREATE TABLE t (id int PRIMARY KEY, v text); INSERT INTO t VALUES (1, 'a'), (2, NULL)",
    )
    .await
    .unwrap();
    b.execute("CREATE TABLE t (id int PRIMARY KEY, v text); INSERT INTO t VALUES (1, 'b')")
        .await
        .unwrap();
    let rows_a = a
        .query_strings("SELECT id, v FROM t ORDER BY id")
        .await
        .unwrap();
    let rows_b = b
        .query_strings("SELECT id, v FROM t ORDER BY id")
        .await
        .unwrap();
    assert_eq!(
        rows_a,
        vec![
            vec![Some("1".to_owned()), Some("a".to_owned())],
            vec![Some("2".to_owned()), None]
        ]
    );
    assert_eq!(
        rows_b,
        vec![vec![Some("1".to_owned()), Some("b".to_owned())]]
    );

    // A failing statement reports the server's error and does not poison
    // the cached session.
    let err = a
        .execute("BEGIN; SELECT * FROM missing_table")
        .await
        .unwrap_err();
    assert!(format!("{err:#}").contains("missing_table"), "{err:#}");
    assert_eq!(
        a.query_one_string("SELECT count(*) FROM t")
            .await
            .unwrap()
            .as_deref(),
        Some("2")
    );

    // A separate connection sees the same data.
    let client = a.connect().await.unwrap();
    let n: i64 = client
        .query_one("SELECT count(*) FROM t", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 2);
}

#[test]
fn server_runs_unprivileged_and_logs_to_its_dir() {
    let (node, took) = start_timed("ident");
    println!("node start time: {took:?}");
    let pid = node.pid().expect("server is running");
    let server_uid = process_uid(pid).unwrap();
    if effective_uid().unwrap() == 0 {
        assert_ne!(server_uid, 0, "postmaster must not run as root");
    } else {
        assert_eq!(server_uid, effective_uid().unwrap());
    }
    assert!(node.log_path().starts_with(node.dir()));
    assert!(
        node.log_tail(60).contains("ready to accept connections"),
        "log: {}",
        node.log_tail(60)
    );
    assert!(node.bin_dir().join("postgres").is_file());
}

#[tokio::test]
async fn committed_data_survives_crashes_and_restarts() {
    let node = PgNode::start("crash").unwrap();
    node.execute("CREATE TABLE t (id int PRIMARY KEY)")
        .await
        .unwrap();
    let port = node.port();

    node.execute("INSERT INTO t VALUES (1)").await.unwrap();
    assert!(node.start_again().is_err(), "already running");
    let t = Instant::now();
    node.stop_immediate().unwrap();
    println!("stop_immediate took {:?}", t.elapsed());
    assert!(node.pid().is_none(), "stopped");
    assert!(node.execute("SELECT 1").await.is_err(), "server is down");
    let t = Instant::now();
    node.start_again().unwrap();
    println!("start_again took {:?}", t.elapsed());
    assert_eq!(node.port(), port, "same port after restart");
    assert_eq!(
        node.query_strings("SELECT id FROM t").await.unwrap(),
        vec![vec![Some("1".to_owned())]]
    );

    node.execute("INSERT INTO t VALUES (2)").await.unwrap();
    let old_pid = node.pid().unwrap();
    let t = Instant::now();
    node.kill9().unwrap();
    println!("kill9 took {:?}", t.elapsed());
    assert!(node.pid().is_none(), "killed");
    let t = Instant::now();
    node.start_again().unwrap();
    println!("start_again took {:?}", t.elapsed());
    assert_ne!(node.pid(), Some(old_pid));
    assert_eq!(
        node.query_strings("SELECT id FROM t ORDER BY id")
            .await
            .unwrap(),
        vec![vec![Some("1".to_owned())], vec![Some("2".to_owned())]]
    );

    node.execute("INSERT INTO t VALUES (3)").await.unwrap();
    let t = Instant::now();
    node.stop().unwrap();
    println!("stop took {:?}", t.elapsed());
    let t = Instant::now();
    node.start_again().unwrap();
    println!("start_again took {:?}", t.elapsed());
    assert_eq!(
        node.query_one_string("SELECT count(*) FROM t")
            .await
            .unwrap()
            .as_deref(),
        Some("3")
    );
}

#[test]
fn drop_stops_the_server_and_removes_its_dir() {
    let node = PgNode::start("dropme").unwrap();
    let dir: PathBuf = node.dir().to_owned();
    let pid = node.pid().unwrap();
    assert!(dir.join("data/PG_VERSION").is_file());
    drop(node);
    assert!(!dir.exists(), "{} still exists", dir.display());
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists() || {
            // A zombie (not reaped by a minimal container init) is dead too.
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            stat.rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
        }
    );
}

#[tokio::test]
async fn password_auth_and_extra_conf() {
    for auth in [Auth::Scram("s3cret'pw".into()), Auth::Md5("md5pw".into())] {
        let node = PgNode::start_with(
            "auth",
            PgOptions::default()
                .conf("work_mem", "7MB")
                .auth(auth.clone()),
        )
        .unwrap();
        // connect() supplies the password.
        assert_eq!(
            node.query_one_string("SHOW work_mem")
                .await
                .unwrap()
                .as_deref(),
            Some("7MB")
        );
        // With a wrong one, the server refuses TCP connections.
        let err = tokio_postgres::connect(
            &format!("{} password=wrong", node.dsn()),
            tokio_postgres::NoTls,
        )
        .await
        .err()
        .expect("connecting with a wrong password must fail");
        assert_eq!(
            err.code(),
            Some(&tokio_postgres::error::SqlState::INVALID_PASSWORD),
            "{auth:?}: {err:?}"
        );
        // The stored verifier matches the method.
        let verifier = node
            .query_one_string("SELECT rolpassword FROM pg_authid WHERE rolname = 'postgres'")
            .await
            .unwrap()
            .unwrap();
        let hba_method = node
            .query_one_string(
                "SELECT DISTINCT auth_method FROM pg_hba_file_rules WHERE type = 'host'",
            )
            .await
            .unwrap();
        let (expected, prefix) = match auth {
            Auth::Scram(_) => ("scram-sha-256", "SCRAM-SHA-256$"),
            Auth::Md5(_) => ("md5", "md5"),
            Auth::Trust => unreachable!(),
        };
        assert!(verifier.starts_with(prefix), "{verifier}");
        assert_eq!(hba_method.as_deref(), Some(expected));
    }
}

/// Run by `leftovers_of_a_crashed_test_process_are_swept` in a child process:
/// starts a node and exits without dropping it, like a crashed test.
#[test]
#[ignore = "helper: only meaningful when spawned by another test"]
fn leftover_child() {
    let Some(out) = std::env::var_os("MM_SMOKE_CHILD_OUT") else {
        return;
    };
    let node = PgNode::start("leftover").unwrap();
    std::fs::write(
        out,
        format!("{}\n{}\n", node.pid().unwrap(), node.dir().display()),
    )
    .unwrap();
    std::process::exit(0);
}

#[test]
fn leftovers_of_a_crashed_test_process_are_swept() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("child");
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["leftover_child", "--exact", "--ignored", "--nocapture"])
        .env("MM_SMOKE_CHILD_OUT", &out)
        .status()
        .unwrap();
    assert!(status.success());
    let text = std::fs::read_to_string(&out).unwrap();
    let mut lines = text.lines();
    let pid: u32 = lines.next().unwrap().parse().unwrap();
    let dir = PathBuf::from(lines.next().unwrap());
    assert!(
        std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "server outlived its test"
    );
    assert!(dir.exists());

    mm_tests::sweep_leftovers().unwrap();
    assert!(!dir.exists(), "{} not swept", dir.display());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let gone = stat.is_empty()
            || stat
                .rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'));
        if gone {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "leftover server {pid} still running"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
