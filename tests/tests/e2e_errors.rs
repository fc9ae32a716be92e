//! Bad input stops only what it must, with an error naming peer, relation
//! and LSN; the rest of the cluster keeps replicating.

use std::time::Duration;

use anyhow::Result;
use mm_tests::{AgentProcess, PgNode, PgOptions, Secrets, TestCluster};

const SCHEMA: &str = "CREATE TABLE kv (id int PRIMARY KEY, v text);";

async fn wait_error(c: &TestCluster, from: &str, to: &str, needle: &str) -> Result<String> {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let s = c.stream_status(from, to).await?;
        if let Some(e) = s.get("last_error").and_then(|e| e.as_str())
            && e.contains(needle)
        {
            return Ok(e.to_owned());
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "stream {from}->{to} never reported an error containing {needle:?}: {s}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_table_and_type_mismatch_stop_only_that_stream() -> Result<()> {
    mm_tests::init_tracing();
    let c = TestCluster::start(&["g1", "g2"], SCHEMA).await?;
    // Tables that exist on g1 only / with another column type on g2.
    c.pg[0]
        .execute("CREATE TABLE only_here (id int PRIMARY KEY)")
        .await?;
    c.pg[0]
        .execute("CREATE TABLE typed (id int PRIMARY KEY, d text)")
        .await?;
    c.pg[1]
        .execute("CREATE TABLE typed (id int PRIMARY KEY, d date)")
        .await?;

    c.pg[0].execute("INSERT INTO only_here VALUES (1)").await?;
    let err = wait_error(&c, "g1", "g2", "only_here").await?;
    assert!(err.contains("g1"), "error does not name the peer: {err}");
    assert!(
        err.contains("public.only_here"),
        "error does not name the relation: {err}"
    );
    assert!(err.contains("LSN"), "error does not name the LSN: {err}");
    // The other direction keeps replicating.
    c.pg[1]
        .execute("INSERT INTO kv VALUES (100, 'from g2')")
        .await?;
    c.wait_for(
        0,
        "SELECT v FROM kv WHERE id = 100",
        "from g2",
        Duration::from_secs(30),
    )
    .await?;
    // Nothing was skipped: once the table exists the stuck transaction applies.
    c.pg[1]
        .execute("CREATE TABLE only_here (id int PRIMARY KEY)")
        .await?;
    c.wait_for(
        1,
        "SELECT count(*) FROM only_here",
        "1",
        Duration::from_secs(60),
    )
    .await?;

    c.pg[0]
        .execute("INSERT INTO typed VALUES (1, 'not a date')")
        .await?;
    let err = wait_error(&c, "g1", "g2", "typed").await?;
    assert!(
        err.contains("22007") || err.contains("invalid input syntax"),
        "{err}"
    );
    c.pg[1]
        .execute("ALTER TABLE typed ALTER COLUMN d TYPE text")
        .await?;
    c.wait_for(
        1,
        "SELECT d FROM typed WHERE id = 1",
        "not a date",
        Duration::from_secs(60),
    )
    .await?;
    c.wait_sync(60).await?;
    c.assert_same("SELECT * FROM kv ORDER BY id").await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_token_is_refused() -> Result<()> {
    mm_tests::init_tracing();
    let c = TestCluster::start(&["t1", "t2"], SCHEMA).await?;
    let dir = tempfile::tempdir()?;
    let bad = dir.path().join("bad-token");
    std::fs::write(&bad, "not-the-token")?;
    let out = mm_tests::mmctl(&c.agents[0].url(), &bad, &["status"]).await?;
    assert!(!out.success());
    assert_eq!(
        out.stderr.trim().lines().count(),
        1,
        "not one line: {}",
        out.stderr
    );
    assert!(
        out.stderr.contains("401")
            || out.stderr.to_lowercase().contains("unauthorized")
            || out.stderr.contains("token"),
        "{}",
        out.stderr
    );
    assert!(
        !out.stderr.contains("not-the-token"),
        "the token leaked into the error"
    );
    // The cluster still works with the right token.
    c.pg[0].execute("INSERT INTO kv VALUES (1, 'ok')").await?;
    c.wait_sync(60).await?;
    c.assert_same("SELECT * FROM kv").await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_down_does_not_stop_the_others() -> Result<()> {
    mm_tests::init_tracing();
    let c = TestCluster::start(&["h1", "h2", "h3"], SCHEMA).await?;
    c.pg[2].stop()?;
    c.pg[0]
        .execute("INSERT INTO kv VALUES (1, 'while h3 is down')")
        .await?;
    c.wait_for(
        1,
        "SELECT v FROM kv WHERE id = 1",
        "while h3 is down",
        Duration::from_secs(30),
    )
    .await?;
    let err = wait_error(&c, "h3", "h1", "h3").await?;
    assert!(!err.is_empty());
    c.pg[2].start_again()?;
    c.wait_sync(120).await?;
    c.assert_same("SELECT * FROM kv ORDER BY id").await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_refuses_unmet_prerequisites_one_line_each() -> Result<()> {
    mm_tests::init_tracing();
    let pg = PgNode::start_with(
        "bad1",
        PgOptions::default()
            .conf("wal_level", "replica")
            .conf("track_commit_timestamp", "off")
            .conf("max_active_replication_origins", "2"),
    )?;
    pg.execute("CREATE TABLE no_key (a int)").await?;
    let dir = tempfile::tempdir()?;
    let secrets = Secrets {
        token_file: dir.path().join("token"),
    };
    std::fs::write(&secrets.token_file, "secret-token-value")?;
    // Four apply lanes need an origin each per peer: 2 is too few.
    let mut agent = AgentProcess::spawn_with("bad1", &pg, &secrets, &[], "apply_lanes = 4\n")?;
    let st = agent.wait_exit(Duration::from_secs(30))?;
    assert!(!st.success());
    let log = agent.log();
    assert!(log.contains("wal_level is 'replica'"), "{log}");
    assert!(log.contains("track_commit_timestamp is 'off'"), "{log}");
    assert!(log.contains("public.no_key"), "{log}");
    assert!(
        log.contains("max_active_replication_origins is 2, must be at least 5"),
        "{log}"
    );
    assert!(!log.contains("secret-token-value"), "token leaked");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unique_violation_stops_the_stream_until_fixed_nothing_skipped() -> Result<()> {
    mm_tests::init_tracing();
    // The `error` resolver: an insert of an existing key stops the stream
    // (with every other resolver it is a resolved conflict).
    let c = TestCluster::start_opts(
        &["u1", "u2"],
        SCHEMA,
        mm_tests::cluster::ClusterOptions {
            agent_toml: "[conflicts]\nresolver = \"error\"\n".into(),
            ..Default::default()
        },
    )
    .await?;
    // A row on u2 that is never replicated (written under a replication
    // origin, which `origin 'none'` filters): the incoming insert collides.
    // The session repairs like an operator would, as a replica (no local
    // tombstone for the delete below).
    let local = c.pg[1].connect().await?;
    local
        .batch_execute(
            "SELECT pg_replication_origin_create('local_fix');
             SELECT pg_replication_origin_session_setup('local_fix');
             SET session_replication_role = replica;
             INSERT INTO kv VALUES (7, 'only on u2');",
        )
        .await?;
    // The failing transaction, and two more right behind it that the agent
    // pipelines before it learns of the failure: they must not commit ahead
    // of it (commit order), or the failed one would be skipped on restart.
    let writer = c.pg[0].connect().await?;
    for sql in [
        "INSERT INTO kv VALUES (7, 'from u1')",
        "INSERT INTO kv VALUES (9, 'after 7')",
        "INSERT INTO kv VALUES (10, 'after 9')",
    ] {
        writer.batch_execute(sql).await?;
    }
    let err = wait_error(&c, "u1", "u2", "insert_exists").await?;
    assert!(err.contains("public.kv"), "{err}");
    assert!(err.contains("u1"), "{err}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        c.rows(1, "SELECT count(*) FROM kv WHERE id IN (9, 10)")
            .await?[0][0]
            .as_deref(),
        Some("0"),
        "transactions after the failed one were applied ahead of it"
    );
    // The other direction still flows.
    c.pg[1]
        .execute("INSERT INTO kv VALUES (8, 'from u2')")
        .await?;
    c.wait_for(
        0,
        "SELECT v FROM kv WHERE id = 8",
        "from u2",
        Duration::from_secs(30),
    )
    .await?;
    // Fix the data: the stuck transaction applies, nothing was skipped.
    local.batch_execute("DELETE FROM kv WHERE id = 7").await?;
    c.wait_for(
        1,
        "SELECT v FROM kv WHERE id = 7",
        "from u1",
        Duration::from_secs(60),
    )
    .await?;
    c.wait_sync(60).await?;
    c.assert_same("SELECT * FROM kv ORDER BY id").await?;
    Ok(())
}
