//! End-to-end: real PostgreSQL 18 nodes, real mm-agent processes, formed with
//! mmctl. Every test compares the nodes' actual rows.

use std::time::Duration;

use anyhow::{Result, ensure};
use mm_tests::TestCluster;

const SCHEMA: &str = "
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
CREATE TABLE kv (id int PRIMARY KEY, v text, n numeric, j jsonb, b bytea, a int[], ts timestamptz, m mood, big text);
CREATE TABLE full_ident (a int, b text);
ALTER TABLE full_ident REPLICA IDENTITY FULL;
CREATE TABLE idx_ident (a int NOT NULL, b text NOT NULL, c text);
CREATE UNIQUE INDEX idx_ident_ab ON idx_ident (a, b);
ALTER TABLE idx_ident REPLICA IDENTITY USING INDEX idx_ident_ab;
-- No primary key on purpose: a duplicate apply would show up as a second row.
CREATE TABLE events (origin text NOT NULL, seq int NOT NULL, payload text);
ALTER TABLE events REPLICA IDENTITY FULL;
";

const DUMP_KV: &str = "SELECT id, v, n, j, b, a, ts, m, md5(big) FROM kv ORDER BY id";
const DUMP_EVENTS: &str = "SELECT origin, seq, payload FROM events ORDER BY origin, seq, payload";

async fn write_disjoint(c: &TestCluster, per_node: i32) -> Result<()> {
    for (i, node) in c.pg.iter().enumerate() {
        let base = (i as i32) * 1_000_000;
        node.execute(&format!(
            "INSERT INTO kv (id, v, n, j, b, a, ts, m)
               SELECT {base} + g, 'v' || g, g * 1.5, jsonb_build_object('g', g), '\\x00ff'::bytea, ARRAY[g, g+1],
                      '2026-01-01 00:00:00+00'::timestamptz + g * interval '1 second', 'ok'
               FROM generate_series(1, {per_node}) g"
        ))
        .await?;
        // Many small transactions too, from each node.
        for k in 0..20 {
            node.execute(&format!(
                "INSERT INTO events VALUES ('{}', {k}, 'x')",
                node.name()
            ))
            .await?;
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_replicate_both_ways() -> Result<()> {
    mm_tests::init_tracing();
    let c = TestCluster::start(&["a1", "a2"], SCHEMA).await?;
    write_disjoint(&c, 500).await?;
    c.wait_sync(60).await?;
    let kv = c.assert_same(DUMP_KV).await?;
    assert_eq!(kv.len(), 1000);
    let ev = c.assert_same(DUMP_EVENTS).await?;
    assert_eq!(ev.len(), 40);
    // /metrics (authenticated) reports the stream into a2: 21 transactions
    // (one bulk insert, 20 single-row ones) and 520 rows from a1.
    let metrics = c.agents[1].metrics(&c.token_file()).await?;
    for line in [
        "mm_stream_applied_transactions_total{from=\"a1\",to=\"a2\"} 21",
        "mm_stream_applied_rows_total{from=\"a1\",to=\"a2\"} 520",
        "mm_stream_state{from=\"a1\",to=\"a2\"} 1",
    ] {
        assert!(metrics.contains(line), "missing {line:?} in\n{metrics}");
    }
    // Lag comes from a probe that runs once a second: give it one round.
    let mut metrics = metrics;
    for _ in 0..30 {
        if metrics.contains("mm_stream_lag_bytes{from=\"a1\",to=\"a2\"}") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        metrics = c.agents[1].metrics(&c.token_file()).await?;
    }
    assert!(metrics.contains("mm_stream_lag_bytes{from=\"a1\",to=\"a2\"}"));
    assert!(metrics.contains("mm_stream_lag_seconds{from=\"a1\",to=\"a2\"}"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_full_mesh_exactly_once_no_loops() -> Result<()> {
    mm_tests::init_tracing();
    let c = TestCluster::start(&["b1", "b2", "b3"], SCHEMA).await?;
    write_disjoint(&c, 300).await?;
    c.wait_sync(60).await?;
    assert_eq!(c.assert_same(DUMP_KV).await?.len(), 900);
    // Exactly once per origin: 20 events from each node, no duplicates on any node.
    let counts = c
        .assert_same("SELECT origin, count(*) FROM events GROUP BY origin ORDER BY origin")
        .await?;
    assert_eq!(counts.len(), 3);
    for row in &counts {
        assert_eq!(row[1].as_deref(), Some("20"), "{row:?}");
    }
    // No loops: after quiescence nothing more is applied anywhere.
    let before = applied_txns(&c).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    c.wait_sync(30).await?;
    let after = applied_txns(&c).await?;
    assert_eq!(
        before, after,
        "transactions kept being applied after quiescence"
    );
    // Each node applied exactly the 21 transactions (1 bulk + 20 small) of
    // each peer, plus one join marker: adding b3 wrote one on the active
    // node that was not its source, and the source applied it (add-node
    // waits for that before it copies: sync/mod.rs).
    for (pair, n) in &after {
        assert!(
            (21..=22).contains(n),
            "applied transactions for {pair}: {n}"
        );
    }
    assert_eq!(
        after.iter().map(|(_, n)| n).sum::<u64>(),
        6 * 21 + 1,
        "applied transactions: {after:?}"
    );
    // Origins carry the remote commits: rows from b1 on b2 have origin mm_b1.
    let origin = c.pg[1]
        .query_one_string(
            "SELECT r.roname FROM events e, pg_xact_commit_timestamp_origin(e.xmin) x \
             JOIN pg_replication_origin r ON r.roident = x.roident WHERE e.origin = 'b1' LIMIT 1",
        )
        .await?;
    assert_eq!(origin.as_deref(), Some("mm_b1"));
    // ... and the publisher's commit timestamp, which last-writer-wins compares.
    let ts_sql =
        "SELECT pg_xact_commit_timestamp(xmin)::text FROM events WHERE origin = 'b1' AND seq = 7";
    let on_b1 = c.pg[0].query_one_string(ts_sql).await?;
    assert!(on_b1.is_some());
    assert_eq!(c.pg[1].query_one_string(ts_sql).await?, on_b1);
    assert_eq!(c.pg[2].query_one_string(ts_sql).await?, on_b1);
    Ok(())
}

/// (from->to, applied txns) for every stream, from every agent's status.
async fn applied_txns(c: &TestCluster) -> Result<Vec<(String, u64)>> {
    // The aggregate status lists every stream as {from, to, applied_txns, ...}.
    let v = c.status_json(0).await?;
    let mut out = Vec::new();
    let mut stack = vec![&v];
    while let Some(x) = stack.pop() {
        match x {
            serde_json::Value::Object(m) => {
                if let (Some(f), Some(t), Some(n)) = (
                    m.get("from").and_then(|v| v.as_str()),
                    m.get("to").and_then(|v| v.as_str()),
                    m.get("applied_txns").and_then(|v| v.as_u64()),
                ) {
                    out.push((format!("{f}->{t}"), n));
                } else {
                    stack.extend(m.values());
                }
            }
            serde_json::Value::Array(a) => stack.extend(a.iter()),
            _ => {}
        }
    }
    out.sort();
    out.dedup();
    anyhow::ensure!(
        out.len() == c.agents.len() * (c.agents.len() - 1),
        "status lists {} streams: {out:?}",
        out.len()
    );
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_shapes_types_toast_identity_truncate() -> Result<()> {
    mm_tests::init_tracing();
    let c = TestCluster::start(&["c1", "c2"], SCHEMA).await?;
    let n1 = &c.pg[0];
    // A TOASTed value (incompressible, > 2 kB) that later updates leave unchanged.
    n1.execute(
        "INSERT INTO kv (id, v, big) SELECT 1, 'first', string_agg(md5(g::text), '') FROM generate_series(1, 400) g;
         INSERT INTO kv (id, v, n, j, b, a, ts, m) VALUES
           (2, NULL, 123456789.123456789, '{\"k\": [1, 2, {\"x\": null}]}', '\\xdeadbeef', '{1,NULL,3}', '2026-11-29 12:34:56.789+05:30', 'happy'),
           (3, 'quote''s \"and\" \\back', -0.0, 'null', '\\x', '{}', 'infinity', 'sad');
         INSERT INTO full_ident VALUES (1, 'a'), (1, 'a'), (2, NULL);
         INSERT INTO idx_ident VALUES (1, 'x', 'c1'), (2, 'y', 'c2');",
    )
    .await?;
    c.wait_sync(60).await?;
    c.assert_same(DUMP_KV).await?;
    // Updates: without key change (TOAST column unchanged), with key change, NULLs.
    n1.execute(
        "UPDATE kv SET v = 'second' WHERE id = 1;
         UPDATE kv SET id = 10, v = 'moved' WHERE id = 2;
         UPDATE kv SET n = NULL, j = NULL WHERE id = 3;
         UPDATE full_ident SET b = 'b' WHERE a = 2;
         DELETE FROM full_ident WHERE ctid = (SELECT ctid FROM full_ident WHERE a = 1 LIMIT 1);
         UPDATE idx_ident SET b = 'z', c = 'changed' WHERE a = 1;
         DELETE FROM idx_ident WHERE a = 2;",
    )
    .await?;
    // A transaction with savepoints, one rolled back.
    n1.execute(
        "BEGIN; INSERT INTO kv (id, v) VALUES (20, 'kept');
         SAVEPOINT s1; INSERT INTO kv (id, v) VALUES (21, 'rolled back'); ROLLBACK TO s1;
         SAVEPOINT s2; INSERT INTO kv (id, v) VALUES (22, 'kept too'); RELEASE s2; COMMIT;",
    )
    .await?;
    c.wait_sync(60).await?;
    let kv = c.assert_same(DUMP_KV).await?;
    let ids: Vec<_> = kv
        .iter()
        .map(|r| r[0].clone().unwrap_or_default())
        .collect();
    assert_eq!(ids, ["1", "3", "10", "20", "22"]);
    assert!(
        kv[0][8].is_some(),
        "TOASTed column was lost by an update that left it unchanged"
    );
    assert_eq!(kv[0][1].as_deref(), Some("second"));
    c.assert_same("SELECT a, b FROM full_ident ORDER BY a, b")
        .await?;
    assert_eq!(
        c.rows(1, "SELECT a, b FROM full_ident ORDER BY a, b")
            .await?,
        vec![
            vec![Some("1".into()), Some("a".into())],
            vec![Some("2".into()), Some("b".into())]
        ]
    );
    assert_eq!(
        c.assert_same("SELECT a, b, c FROM idx_ident ORDER BY a")
            .await?,
        vec![vec![
            Some("1".into()),
            Some("z".into()),
            Some("changed".into())
        ]]
    );
    // TRUNCATE replicates too.
    n1.execute("TRUNCATE full_ident").await?;
    c.wait_sync(60).await?;
    assert_eq!(
        c.rows(1, "SELECT count(*) FROM full_ident").await?[0][0].as_deref(),
        Some("0")
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn added_column_is_picked_up_without_restart() -> Result<()> {
    mm_tests::init_tracing();
    let c = TestCluster::start(&["d1", "d2"], SCHEMA).await?;
    c.pg[0]
        .execute("INSERT INTO kv (id, v) VALUES (1, 'before')")
        .await?;
    c.wait_sync(60).await?;
    for n in &c.pg {
        n.execute("ALTER TABLE kv ADD COLUMN extra text").await?;
    }
    c.pg[0]
        .execute("INSERT INTO kv (id, v, extra) VALUES (2, 'after', 'new column')")
        .await?;
    c.pg[1]
        .execute("UPDATE kv SET extra = 'from d2' WHERE id = 1")
        .await?;
    c.wait_sync(60).await?;
    let rows = c
        .assert_same("SELECT id, v, extra FROM kv ORDER BY id")
        .await?;
    assert_eq!(rows[1][2].as_deref(), Some("new column"));
    assert_eq!(rows[0][2].as_deref(), Some("from d2"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_holds_changes_and_resume_delivers_them() -> Result<()> {
    mm_tests::init_tracing();
    let mut c = TestCluster::start(&["e1", "e2"], SCHEMA).await?;
    c.mmctl(0, &["pause", "--from", "e1", "--to", "e2"])
        .await?
        .ok()?;
    c.pg[0]
        .execute("INSERT INTO kv (id, v) VALUES (1, 'held')")
        .await?;
    c.pg[1]
        .execute("INSERT INTO kv (id, v) VALUES (2, 'flows')")
        .await?;
    // wait-sync fails on the paused stream with a change waiting, naming it
    // (SPEC §4), and with --ignore-paused waits only on the others.
    let out = c.mmctl(0, &["wait-sync", "--timeout", "30"]).await?;
    ensure!(
        !out.success() && out.stderr.contains("e1 → e2") && out.stderr.contains("paused"),
        "wait-sync with e1 -> e2 paused and behind: {}{}",
        out.stdout,
        out.stderr
    );
    c.wait_sync_ignore_paused(60).await?;
    assert_eq!(
        c.rows(0, "SELECT count(*) FROM kv").await?[0][0].as_deref(),
        Some("2")
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        c.rows(1, "SELECT count(*) FROM kv").await?[0][0].as_deref(),
        Some("1")
    );
    let st = c.mmctl(1, &["status"]).await?.ok()?;
    assert!(
        st.stdout.contains("paused"),
        "status does not show the pause:\n{}",
        st.stdout
    );
    // The pause survives an agent restart: it lives in Raft.
    c.agents[1].kill9()?;
    c.agents[1].start()?;
    c.agents[1].wait_ready(Duration::from_secs(30)).await?;
    c.pg[0]
        .execute("INSERT INTO kv (id, v) VALUES (3, 'held too')")
        .await?;
    c.wait_sync_ignore_paused(60).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        c.rows(1, "SELECT count(*) FROM kv").await?[0][0].as_deref(),
        Some("1")
    );
    assert_eq!(
        c.stream_status("e1", "e2").await?["state"].as_str(),
        Some("paused")
    );
    c.mmctl(0, &["resume", "--from", "e1", "--to", "e2"])
        .await?
        .ok()?;
    c.wait_sync(60).await?;
    c.assert_same(DUMP_KV).await?;
    Ok(())
}

/// A backlog of single-row transactions is applied in batches (one Sync per
/// batch on the apply session, `apply/pipeline.rs`), yet every remote
/// transaction stays a local transaction of its own with its own commit
/// timestamp: sent without a Sync between them, statements outside a
/// transaction block would share one implicit transaction, and every row
/// of a batch would carry its last commit's timestamp, which
/// last-writer-wins then compares.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_of_single_row_transactions_keeps_each_commit() -> Result<()> {
    mm_tests::init_tracing();
    let c = TestCluster::start(&["s1", "s2"], SCHEMA).await?;
    c.mmctl(0, &["pause", "--from", "s1", "--to", "s2"])
        .await?
        .ok()?;
    for i in 0..300 {
        c.pg[0]
            .execute(&format!("INSERT INTO kv (id, v) VALUES ({i}, 'v{i}')"))
            .await?;
    }
    for i in (0..300).step_by(3) {
        c.pg[0]
            .execute(&format!("UPDATE kv SET v = 'u{i}' WHERE id = {i}"))
            .await?;
    }
    for i in (1..300).step_by(5) {
        c.pg[0]
            .execute(&format!("DELETE FROM kv WHERE id = {i}"))
            .await?;
    }
    c.mmctl(0, &["resume", "--from", "s1", "--to", "s2"])
        .await?
        .ok()?;
    c.wait_sync(60).await?;
    let dump = "SELECT id, v, pg_xact_commit_timestamp(xmin)::text FROM kv ORDER BY id";
    let (on_s1, on_s2) = (c.rows(0, dump).await?, c.rows(1, dump).await?);
    assert_eq!(on_s1.len(), 240);
    assert_eq!(
        on_s2, on_s1,
        "rows or their commit timestamps differ after the backlog"
    );
    let distinct = "SELECT count(DISTINCT xmin::text)::text FROM kv";
    assert_eq!(
        c.rows(1, distinct).await?[0][0].as_deref(),
        Some("240"),
        "remote transactions were merged into fewer local ones"
    );
    let applied = applied_txns(&c).await?;
    assert!(
        applied.contains(&("s1->s2".to_owned(), 300 + 100 + 60)),
        "applied transactions: {applied:?}"
    );
    // Each of them updated the progress row: its page is pruned after a few
    // versions (schema 9), not after ~90 that its guard's probe walks.
    let fillfactor =
        "SELECT reloptions::text FROM pg_class WHERE oid = 'mm.apply_progress'::regclass";
    assert_eq!(
        c.rows(1, fillfactor).await?[0][0].as_deref(),
        Some("{fillfactor=10}")
    );
    Ok(())
}

/// Fixed-length types keep their values and find their rows. The apply
/// path casts its parameters to the local column types: `character` read
/// without a type modifier means `character(1)`, and `bit` means `bit(1)`,
/// so a cast to them cut 'abcd' to 'a' and matched key 'ab' to row 'a'.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixed_length_types_keep_their_values_and_rows() -> Result<()> {
    mm_tests::init_tracing();
    let schema =
        "CREATE TABLE fx (k char(4) PRIMARY KEY, c char(6), b bit(4), vb varbit(8), s varchar(5));";
    let c = TestCluster::start(&["fx1", "fx2"], schema).await?;
    for sql in [
        "INSERT INTO fx VALUES ('a', 'x', B'1010', B'101', 'abc')",
        "INSERT INTO fx VALUES ('ab', 'hello', B'0110', B'11110000', 'de')",
        "INSERT INTO fx VALUES ('abcd', 'yz', B'1111', B'1', 'fghij')",
        "UPDATE fx SET c = 'world', b = B'0001' WHERE k = 'ab'",
        "DELETE FROM fx WHERE k = 'abcd'",
    ] {
        c.pg[0].execute(sql).await?;
    }
    c.wait_sync(60).await?;
    let rows = c
        .assert_same("SELECT k, c, b::text, vb::text, s FROM fx ORDER BY k")
        .await?;
    let want = [
        ["a   ", "x     ", "1010", "101", "abc"],
        ["ab  ", "world ", "0001", "11110000", "de"],
    ];
    let got: Vec<Vec<String>> = rows
        .iter()
        .map(|r| r.iter().map(|v| v.clone().unwrap_or_default()).collect())
        .collect();
    ensure!(
        got == want.map(|r| r.map(str::to_owned).to_vec()).to_vec(),
        "rows on fx2: {got:?}, want {want:?}"
    );
    Ok(())
}
