//! Parallel apply lanes (`replication.apply_lanes`): the subscriber commits
//! exactly the publisher's transactions, once each, in the publisher's
//! order, whatever lane applied them; transactions that depend on each
//! other (same row, same unique value, a foreign-key parent and child, a
//! table with a trigger that fires on apply) are never applied out of
//! order; and all of it holds across kill -9 of the agent and a crash of
//! PostgreSQL in the middle of multi-lane apply.
//!
//! Commit order is read from the WAL itself: a pgoutput slot on each node,
//! created before the workload, decodes its commits in commit order
//! (`origin 'any'` on the subscriber, whose commits all carry an origin).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use mm_proto::client::{ReplicationClient, ReplicationConfig, SnapshotAction};
use mm_proto::pgoutput::{ColumnValue, Message};
use mm_tests::cluster::ClusterOptions;
use mm_tests::wal::WalStream;
use mm_tests::{PgNode, TestCluster};

const LANES_TOML: &str = "apply_lanes = 4\n";

const SCHEMA: &str = "
CREATE TABLE items (id int PRIMARY KEY, v int NOT NULL);
CREATE TABLE hot (id int PRIMARY KEY, n int NOT NULL);
CREATE TABLE uniq (id int PRIMARY KEY, email text NOT NULL UNIQUE);
CREATE TABLE parent (id int PRIMARY KEY);
CREATE TABLE child (id int PRIMARY KEY, parent_id int NOT NULL REFERENCES parent);
CREATE TABLE trig (id int PRIMARY KEY);
CREATE SCHEMA audit;
CREATE TABLE audit.trig_log (seq bigserial PRIMARY KEY, id int NOT NULL);
CREATE FUNCTION audit.log_trig() RETURNS trigger LANGUAGE plpgsql AS
  $$ BEGIN INSERT INTO audit.trig_log (id) VALUES (NEW.id); RETURN NEW; END $$;
CREATE TRIGGER log_trig AFTER INSERT ON trig FOR EACH ROW EXECUTE FUNCTION audit.log_trig();
ALTER TABLE trig ENABLE ALWAYS TRIGGER log_trig;
";

fn repl_config(node: &PgNode) -> Result<ReplicationConfig> {
    Ok(ReplicationConfig::from_dsn(&node.dsn())?.with_portable_text_settings())
}

async fn create_slot(node: &PgNode, slot: &str) -> Result<()> {
    let mut client = ReplicationClient::connect(&repl_config(node)?).await?;
    client
        .create_logical_slot(slot, "pgoutput", SnapshotAction::NoExport, false)
        .await?;
    client.close().await;
    Ok(())
}

/// The first `txns` transactions `slot` decodes, in commit order, each as
/// its row changes: "I items 5", "U hot 2", "D uniq 7" (first column).
async fn commit_sequence(node: &PgNode, slot: &str, txns: usize) -> Result<Vec<Vec<String>>> {
    let options = [
        ("proto_version", "4"),
        ("publication_names", "\"mm\""),
        ("origin", "any"),
    ];
    let mut stream = WalStream::start(&repl_config(node)?, slot, &options).await?;
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut names: HashMap<u32, String> = HashMap::new();
    let mut out = Vec::new();
    let mut open: Vec<String> = Vec::new();
    let first = |cols: &[ColumnValue]| match cols.first() {
        Some(ColumnValue::Text(b)) => String::from_utf8_lossy(b).into_owned(),
        other => format!("{other:?}"),
    };
    while out.len() < txns {
        let r = stream
            .next(deadline)
            .await
            .with_context(|| format!("{slot}: after {} of {txns} transactions", out.len()))?;
        let rel = |oid: u32| names.get(&oid).cloned().unwrap_or_else(|| oid.to_string());
        match &r.msg {
            Message::Relation(rel) => {
                names.insert(rel.oid, rel.name.clone());
            }
            Message::Insert(i) => open.push(format!(
                "I {} {}",
                rel(i.relation_oid),
                first(&i.new.columns)
            )),
            Message::Update(u) => open.push(format!(
                "U {} {}",
                rel(u.relation_oid),
                first(&u.new.columns)
            )),
            Message::Delete(d) => {
                let key = match &d.old {
                    mm_proto::pgoutput::OldTuple::Key(k) => format!("{k:?}"),
                    mm_proto::pgoutput::OldTuple::Full(t) => first(&t.columns),
                };
                open.push(format!("D {} {key}", rel(d.relation_oid)));
            }
            Message::Commit(_) => out.push(std::mem::take(&mut open)),
            _ => {}
        }
    }
    Ok(out)
}

/// The subscriber (node 1) committed exactly the publisher's (node 0)
/// `txns` transactions, each once, in the publisher's order (slots
/// `order_a` and `order_b`, created before the workload).
async fn same_commits(c: &TestCluster, txns: usize, context: &str) -> Result<()> {
    let a = commit_sequence(&c.pg[0], "order_a", txns).await?;
    let b = commit_sequence(&c.pg[1], "order_b", txns).await?;
    if let Some(k) = (0..txns).find(|k| a[*k] != b[*k]) {
        bail!(
            "{context}commit {k} differs: publisher {:?}, subscriber {:?}",
            a[k],
            b[k]
        );
    }
    Ok(())
}

/// Runs each statement as its own transaction on node `i`; returns how many.
async fn run_each(c: &TestCluster, i: usize, stmts: &[String]) -> Result<usize> {
    let client = c.pg[i].connect().await?;
    for s in stmts {
        client.batch_execute(s).await.with_context(|| s.clone())?;
    }
    Ok(stmts.len())
}

async fn one(c: &TestCluster, i: usize, sql: &str) -> Result<String> {
    let r = c.rows(i, sql).await?;
    Ok(r[0][0].clone().unwrap_or_default())
}

/// Nothing on `i` says a transaction was applied twice, out of order or
/// against the resolver: no conflict was logged, none rolled back.
async fn no_conflicts(c: &TestCluster, i: usize, from: &str, to: &str) -> Result<()> {
    let logged = one(c, i, "SELECT count(*) FROM mm.conflict_log").await?;
    ensure!(logged == "0", "{logged} conflicts logged on {to}");
    let s = c.stream_status(from, to).await?;
    ensure!(
        s["conflict_rollbacks"].as_u64() == Some(0),
        "rolled back on {to}: {s}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lanes_apply_dependent_transactions_in_order_and_commit_in_the_publishers_order()
-> Result<()> {
    mm_tests::init_tracing();
    let c = TestCluster::start_opts(
        &["la", "lb"],
        SCHEMA,
        ClusterOptions {
            agent_toml: LANES_TOML.into(),
            ..ClusterOptions::default()
        },
    )
    .await?;
    c.pg[0]
        .execute("INSERT INTO hot SELECT g, 0 FROM generate_series(1, 5) g; INSERT INTO uniq VALUES (0, 'x')")
        .await?;
    c.wait_sync(60).await?;
    create_slot(&c.pg[0], "order_a").await?;
    create_slot(&c.pg[1], "order_b").await?;

    // A backlog, so that every lane has work at once.
    c.pause("la", "lb").await?;
    let n = 200;
    let mut expected_items = 0;
    let mut stmts = Vec::new();
    for i in 1..=n {
        // A larger transaction keeps its lane busy for a while; the delete
        // and the update touch its rows: placed anywhere else, they would
        // run first.
        // Every tenth is large enough to be still running when the next
        // one is received.
        let rows = if i % 10 == 0 { 3000 } else { 100 };
        expected_items += rows - 2 + 100;
        stmts.push(format!(
            "BEGIN; INSERT INTO items SELECT g, g FROM generate_series({}, {}) g; \
             UPDATE hot SET n = n + 1 WHERE id = {}; COMMIT",
            i * 10_000,
            i * 10_000 + rows - 1,
            i % 5 + 1
        ));
        // Two statements each: a transaction of one row waits for the one
        // before it ahead of its only statement, wherever it is placed;
        // these change rows first and wait at their end.
        stmts.push(format!(
            "BEGIN; DELETE FROM items WHERE id = {0}; DELETE FROM items WHERE id = {0} + 1; COMMIT",
            i * 10_000
        ));
        stmts.push(format!(
            "BEGIN; UPDATE hot SET n = n + 1 WHERE id = {0}; UPDATE hot SET n = n + 1 WHERE id = {0}; COMMIT",
            i % 5 + 1
        ));
        // An independent one: another lane, at the same time.
        stmts.push(format!(
            "BEGIN; INSERT INTO items SELECT g, g FROM generate_series({}, {}) g; COMMIT",
            10_000_000 + i * 100,
            10_000_000 + i * 100 + 99
        ));
        if i % 3 == 0 {
            // A unique value freed, then taken by another row.
            stmts.push(format!("UPDATE uniq SET email = 'm{i}' WHERE email = 'x'"));
            stmts.push(format!("INSERT INTO uniq VALUES ({i}, 'x')"));
        }
        if i % 4 == 0 {
            // A foreign-key parent, then its child.
            stmts.push(format!("INSERT INTO parent VALUES ({i})"));
            stmts.push(format!("INSERT INTO child VALUES ({i}, {i})"));
        }
        if i % 2 == 0 {
            // A table whose trigger fires on apply: its order is visible.
            stmts.push(format!("INSERT INTO trig VALUES ({i})"));
        }
    }
    let txns = run_each(&c, 0, &stmts).await?;
    c.resume("la", "lb").await?;
    c.wait_sync(120).await?;

    for t in ["items", "hot", "uniq", "parent", "child", "trig"] {
        c.assert_same(&format!("SELECT * FROM {t} ORDER BY 1"))
            .await?;
    }
    assert_eq!(
        one(&c, 1, "SELECT count(*) FROM items").await?,
        expected_items.to_string()
    );
    assert_eq!(
        one(&c, 1, "SELECT sum(n) FROM hot").await?,
        (3 * n).to_string()
    );
    no_conflicts(&c, 1, "la", "lb").await?;
    // The trigger fired in the publisher's order.
    let out_of_order = one(
        &c,
        1,
        "SELECT count(*) FROM (SELECT id, lag(id) OVER (ORDER BY seq) AS p FROM audit.trig_log) s \
         WHERE p >= id",
    )
    .await?;
    assert_eq!(out_of_order, "0");
    assert_eq!(
        one(&c, 1, "SELECT count(*) FROM audit.trig_log").await?,
        (n / 2).to_string()
    );
    // Several lanes applied the rows: their commits carry several origins.
    let origins = one(
        &c,
        1,
        "SELECT count(DISTINCT (pg_xact_commit_timestamp_origin(xmin)).roident) FROM items",
    )
    .await?;
    ensure!(
        origins.parse::<u32>()? >= 2,
        "items applied through {origins} origin(s): the lanes did not run"
    );
    let lane_origins = one(
        &c,
        1,
        "SELECT count(*) FROM pg_replication_origin WHERE roname LIKE 'mm\\_la#%'",
    )
    .await?;
    assert_eq!(lane_origins, "3");
    same_commits(&c, txns, "").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lanes_keep_exactly_once_and_commit_order_across_agent_and_postgres_crashes() -> Result<()>
{
    mm_tests::init_tracing();
    let seed = mm_tests::rng::seed()?;
    let mut rng = mm_tests::rng::Rng::new(seed);
    eprintln!("MM_SEED={seed}");
    let mut c = TestCluster::start_opts(
        &["ca", "cb"],
        "CREATE TABLE items (id int PRIMARY KEY, v int NOT NULL);
         CREATE TABLE big (id int PRIMARY KEY, v text NOT NULL);",
        ClusterOptions {
            agent_toml: LANES_TOML.into(),
            ..ClusterOptions::default()
        },
    )
    .await?;
    create_slot(&c.pg[0], "order_a").await?;
    create_slot(&c.pg[1], "order_b").await?;
    c.pause("ca", "cb").await?;
    let mut stmts = Vec::new();
    for i in 1..=3000 {
        stmts.push(format!("INSERT INTO items VALUES ({i}, {i})"));
        if i % 10 == 0 {
            stmts.push(format!("UPDATE items SET v = v + 1 WHERE id = {}", i - 5));
        }
        if i % 600 == 0 {
            // Large transactions among the small ones.
            stmts.push(format!(
                "INSERT INTO big SELECT g, repeat('y', 40) FROM generate_series({}, {}) g",
                i * 1000,
                i * 1000 + 999
            ));
        }
    }
    let txns = run_each(&c, 0, &stmts).await?;
    c.resume("ca", "cb").await?;
    // kill -9 of the subscriber's agent, twice, at seeded moments.
    for _ in 0..2 {
        tokio::time::sleep(Duration::from_millis(200 + rng.below(1200))).await;
        c.agents[1].kill9()?;
        c.agents[1].start()?;
        c.agents[1].wait_ready(Duration::from_secs(30)).await?;
    }
    // A crash of the subscriber's PostgreSQL (no checkpoint: recovery).
    tokio::time::sleep(Duration::from_millis(200 + rng.below(1000))).await;
    c.pg[1].stop_immediate()?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    c.pg[1].start_again()?;
    c.wait_sync(180).await?;

    c.assert_same("SELECT * FROM items ORDER BY 1").await?;
    c.assert_same("SELECT count(*), sum(id) FROM big").await?;
    assert_eq!(one(&c, 1, "SELECT count(*) FROM items").await?, "3000");
    assert_eq!(one(&c, 1, "SELECT count(*) FROM big").await?, "5000");
    let origins = one(
        &c,
        1,
        "SELECT count(DISTINCT (pg_xact_commit_timestamp_origin(xmin)).roident) FROM items",
    )
    .await?;
    ensure!(origins.parse::<u32>()? >= 2, "one lane applied everything");
    // A transaction applied twice would have met its own rows: a conflict.
    let logged = one(&c, 1, "SELECT count(*) FROM mm.conflict_log").await?;
    assert_eq!(
        logged, "0",
        "conflicts logged: a transaction applied twice?"
    );
    same_commits(&c, txns, &format!("MM_SEED={seed}: ")).await
}

/// How often the subscriber's server log says `what`.
fn log_count(node: &PgNode, what: &str) -> Result<usize> {
    let log = std::fs::read_to_string(node.log_path())
        .with_context(|| format!("reading {}", node.log_path().display()))?;
    Ok(log.matches(what).count())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lanes_spread_single_row_transactions_and_go_on_after_a_conflict_among_them() -> Result<()>
{
    mm_tests::init_tracing();
    let c = TestCluster::start_opts(
        &["sa", "sb"],
        "CREATE TABLE items (id int PRIMARY KEY, v int NOT NULL);",
        ClusterOptions {
            agent_toml: "apply_lanes = 2\n".into(),
            ..ClusterOptions::default()
        },
    )
    .await?;
    c.pause("sa", "sb").await?;
    c.pause("sb", "sa").await?;
    // Rows the subscriber wrote itself, older than the publisher's: the
    // publisher's inserts of them conflict in the middle of lane apply.
    let conflicting = [700, 1400];
    for id in conflicting {
        c.pg[1]
            .execute(&format!("INSERT INTO items VALUES ({id}, -1)"))
            .await?;
    }
    // One statement per transaction: the common OLTP shape, which before
    // the lanes' tokens stayed on one lane.
    let n = 2000;
    let stmts: Vec<String> = (1..=n)
        .map(|i| format!("INSERT INTO items VALUES ({i}, {i})"))
        .collect();
    run_each(&c, 0, &stmts).await?;
    let started = Instant::now();
    c.resume("sa", "sb").await?;
    c.wait_for(
        1,
        "SELECT count(*) FROM items WHERE v > 0",
        &n.to_string(),
        Duration::from_secs(120),
    )
    .await?;
    let took = started.elapsed();
    c.resume("sb", "sa").await?;
    c.wait_sync(120).await?;

    c.assert_same("SELECT * FROM items ORDER BY 1").await?;
    assert_eq!(
        one(&c, 1, "SELECT count(*) FROM items").await?,
        n.to_string()
    );
    assert_eq!(
        one(&c, 1, "SELECT count(*) FROM items WHERE v < 0").await?,
        "0",
        "the publisher's newer rows win"
    );
    let logged = one(&c, 1, "SELECT count(*) FROM mm.conflict_log").await?;
    assert_eq!(logged, conflicting.len().to_string());
    // Consecutive transactions went to different lanes, not runs of them
    // to one lane at a time (ids were inserted in commit order). With 2
    // lanes a transaction stays in its predecessor's lane only while it
    // cannot be sure of that lane's token (`lanes.rs`).
    let switches: u64 = one(
        &c,
        1,
        "SELECT count(*) FROM (SELECT o, lag(o) OVER (ORDER BY id) AS p FROM \
         (SELECT id, (pg_xact_commit_timestamp_origin(xmin)).roident AS o FROM items) s) t \
         WHERE o <> p",
    )
    .await?
    .parse()?;
    ensure!(
        switches >= n / 4,
        "{switches} of {n} single-row transactions went to another lane than the one before: \
         they did not spread over the lanes"
    );
    // The failed lane let go of its tokens at once: no lane waited until
    // its lock timeout, and no transaction let go of a token it did not
    // hold (the tokens' bookkeeping is exact).
    assert_eq!(
        log_count(&c.pg[1], "lock timeout")?,
        0,
        "waited for a token until the lock timeout"
    );
    assert_eq!(
        log_count(&c.pg[1], "you don't own a lock")?,
        0,
        "a token let go twice"
    );
    eprintln!("caught up in {took:?}, {switches} lane switches in {n} transactions");
    Ok(())
}
