//! add-node with data: a node joins a cluster that holds rows and keeps
//! taking writes on every node, and ends with exactly every row, each with
//! the version (commit timestamp) it has everywhere else.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use mm_tests::rng::Rng;
use mm_tests::{AgentProcess, PgNode, PgOptions, TestCluster};

const SCHEMA: &str = "
CREATE TYPE mood AS ENUM ('calm', 'busy');
CREATE TABLE kv (id bigint PRIMARY KEY, v text NOT NULL, m mood NOT NULL DEFAULT 'calm', n int NOT NULL DEFAULT 0);
CREATE TABLE ident (id int GENERATED ALWAYS AS IDENTITY PRIMARY KEY, note text, twice int GENERATED ALWAYS AS (length(note) * 2) STORED);
CREATE TABLE big (id int PRIMARY KEY, doc text NOT NULL);
ALTER TABLE big ALTER COLUMN doc SET STORAGE EXTERNAL;
CREATE TABLE part (id int, region text, v text, PRIMARY KEY (id, region)) PARTITION BY LIST (region);
CREATE TABLE part_eu PARTITION OF part FOR VALUES IN ('eu');
CREATE TABLE part_us PARTITION OF part FOR VALUES IN ('us');
CREATE TABLE nokey (a int, b text);
ALTER TABLE nokey REPLICA IDENTITY FULL;
CREATE INDEX kv_v ON kv (v);";

/// Rows loaded before the join, in `LOAD_TXNS` transactions, plus
/// `SINGLE_TXNS` one-row transactions (versions the copy keeps one by one).
const LOAD_ROWS: i64 = 500_000;
const LOAD_TXNS: i64 = 4;
const SINGLE_TXNS: i64 = 300;

fn rows_to_load() -> i64 {
    std::env::var("MM_JOIN_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(LOAD_ROWS)
}

async fn load(c: &TestCluster, rows: i64) -> Result<()> {
    let per = rows / LOAD_TXNS;
    for t in 0..LOAD_TXNS {
        let node = (t as usize) % c.pg.len();
        c.pg[node]
            .execute(&format!(
                "INSERT INTO kv (id, v) SELECT g, 'load-' || g FROM generate_series({}, {}) g",
                t * per + 1,
                (t + 1) * per
            ))
            .await?;
    }
    for i in 0..SINGLE_TXNS {
        let node = (i as usize) % c.pg.len();
        c.pg[node]
            .execute(&format!(
                "UPDATE kv SET v = 'single-{i}', m = 'busy' WHERE id = {}",
                i * 37 + 1
            ))
            .await?;
    }
    c.pg[0]
        .execute(
            "INSERT INTO ident (note) SELECT 'note ' || g FROM generate_series(1, 500) g;
             INSERT INTO big SELECT g, repeat(md5(g::text), 300) FROM generate_series(1, 40) g;
             INSERT INTO part SELECT g, CASE WHEN g % 2 = 0 THEN 'eu' ELSE 'us' END, 'p' || g FROM generate_series(1, 1000) g;
             INSERT INTO nokey SELECT g % 10, 'x' || g FROM generate_series(1, 2000) g;
             DELETE FROM kv WHERE id % 1000 = 7;",
        )
        .await?;
    Ok(())
}

/// What one writer did: writes that committed, and of them the inserts
/// (rows `w{i}-*`, which nothing else touches: each must be on every node
/// exactly once).
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    writes: u64,
    inserts: u64,
}

/// Writes on node `i` until `stop`: inserts of its own keys, updates and
/// deletes anywhere in the loaded range.
async fn writer(
    conn: tokio_postgres::Client,
    i: usize,
    seed: u64,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<Tally> {
    let mut rng = Rng::new(seed ^ ((i as u64 + 1) * 0x9E37_79B9));
    let mut t = Tally::default();
    let mut next = 10_000_000 * (i as i64 + 1);
    while !*stop.borrow() {
        let k = 1 + rng.below(rows_to_load() as u64) as i64;
        let done = t.writes;
        let (insert, sql) = match rng.below(6) {
            0 | 1 => {
                next += 1;
                (
                    true,
                    format!("INSERT INTO kv (id, v) VALUES ({next}, 'w{i}-{done}')"),
                )
            }
            2 | 3 => (
                false,
                format!("UPDATE kv SET v = 'u{i}-{done}', n = n + 1 WHERE id = {k}"),
            ),
            4 => (false, format!("DELETE FROM kv WHERE id = {k}")),
            _ => (
                false,
                format!(
                    "UPDATE big SET doc = repeat(md5('{i}-{done}'), 300) WHERE id = {}",
                    1 + k % 40
                ),
            ),
        };
        match conn.batch_execute(&sql).await {
            Ok(()) => {
                t.writes += 1;
                t.inserts += u64::from(insert);
            }
            // A deadlock with an apply session: this write did not happen.
            Err(e) if e.code().is_some_and(|s| s.code().starts_with("40")) => {}
            Err(e) => return Err(e).context(sql),
        }
        tokio::time::sleep(Duration::from_millis(5 + rng.below(20))).await;
    }
    Ok(t)
}

/// Each writer's inserts are on every node exactly once, and no node ever
/// saw one of them arrive twice (an `insert_exists` conflict).
async fn assert_each_once(c: &TestCluster, tallies: &[(usize, Tally)]) -> Result<()> {
    for (i, pg) in c.pg.iter().enumerate() {
        for (w, t) in tallies {
            let n = pg
                .query_one_string(&format!("SELECT count(*) FROM kv WHERE v LIKE 'w{w}-%'"))
                .await?;
            ensure!(
                n == Some(t.inserts.to_string()),
                "node {i} holds {n:?} of writer {w}'s {} inserts",
                t.inserts
            );
        }
        let twice = pg
            .query_one_string(
                "SELECT count(*) FROM mm.conflict_log WHERE conflict_type = 'insert_exists'",
            )
            .await?;
        ensure!(
            twice.as_deref() == Some("0"),
            "node {i} logged {twice:?} insert_exists conflicts: a change arrived twice"
        );
    }
    Ok(())
}

/// Writes 1000 `part` rows (ids 2001..=3000) on node `i` while its
/// commit timestamps are off, as in a database from before mm: rows
/// without a version. (Turning them off forgets every older version on
/// that node too: run it before anything else is loaded.)
async fn unversioned_part(c: &TestCluster, i: usize) -> Result<()> {
    let pg = &c.pg[i];
    pg.execute("ALTER SYSTEM SET track_commit_timestamp = off")
        .await?;
    pg.stop()?;
    pg.start_again()?;
    pg.execute(
        "INSERT INTO part SELECT g, CASE WHEN g % 2 = 0 THEN 'eu' ELSE 'us' END, 'old' || g \
         FROM generate_series(2001, 3000) g",
    )
    .await?;
    pg.execute("ALTER SYSTEM RESET track_commit_timestamp")
        .await?;
    pg.stop()?;
    pg.start_again()?;
    let none = pg
        .query_one_string(
            "SELECT count(*) FROM part WHERE pg_xact_commit_timestamp(xmin) IS NULL AND id > 2000",
        )
        .await?;
    ensure!(
        none.as_deref() == Some("1000"),
        "part rows without a version: {none:?}"
    );
    Ok(())
}

/// A node and its agent, not a member yet; `schema` runs on it first.
async fn new_node(c: &mut TestCluster, name: &str, schema: &str) -> Result<()> {
    let pg = PgNode::start_with(name, PgOptions::default())?;
    if !schema.is_empty() {
        pg.execute(schema).await?;
    }
    let mut agent = AgentProcess::spawn(name, &pg, &c.secrets)?;
    agent.wait_ready(Duration::from_secs(30)).await?;
    c.pg.push(pg);
    c.agents.push(agent);
    Ok(())
}

/// Every replicated table identical on every node, and every row's commit
/// timestamp too: the copy kept the versions last-writer-wins compares.
async fn assert_converged(c: &TestCluster) -> Result<usize> {
    let kv = c
        .assert_same("SELECT id, v, m, n FROM kv ORDER BY id")
        .await?;
    c.assert_same(
        "SELECT id, pg_xact_commit_timestamp(xmin)::text FROM kv \
         WHERE pg_xact_commit_timestamp(xmin) IS NOT NULL ORDER BY id",
    )
    .await
    .context("row versions differ")?;
    c.assert_same("SELECT id, note, twice FROM ident ORDER BY id")
        .await?;
    c.assert_same("SELECT id, md5(doc), pg_xact_commit_timestamp(xmin)::text FROM big ORDER BY id")
        .await?;
    c.assert_same("SELECT tableoid::regclass::text, id, region, v FROM part ORDER BY id")
        .await?;
    // (`part`'s ids over 2000 have no version on one node: see
    // `unversioned_part`.)
    c.assert_same(
        "SELECT id, pg_xact_commit_timestamp(xmin)::text FROM part \
         WHERE id <= 2000 ORDER BY id",
    )
    .await
    .context("part's row versions differ")?;
    // A table without a key (REPLICA IDENTITY FULL).
    c.assert_same("SELECT a, b, count(*) FROM nokey GROUP BY a, b ORDER BY a, b")
        .await?;
    Ok(kv.len())
}

/// Runs `mmctl add-node` of the newest node through node 0; returns the
/// progress events and how long it took.
async fn add_newest(c: &TestCluster, extra: &[&str]) -> Result<Duration> {
    let i = c.agents.len() - 1;
    let name = c.agents[i].name.clone();
    let url = c.agents[i].url();
    let started = std::time::Instant::now();
    let mut args = vec!["--json", "add-node", "--name", &name, "--url", &url];
    args.extend_from_slice(extra);
    let out = c.mmctl(0, &args).await?;
    let took = started.elapsed();
    ensure!(
        out.success(),
        "add-node {name} failed: {}{}",
        out.stderr,
        out.stdout
    );
    let added = out.json()?;
    ensure!(added["state"] == "active", "{added}");
    // Progress came as JSON events on stderr while it ran.
    let events: Vec<serde_json::Value> = out
        .stderr
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    ensure!(
        events
            .iter()
            .any(|e| e["event"] == "add-node" && e["progress"]["phase"].is_string()),
        "no progress events: {}",
        out.stderr
    );
    Ok(took)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn add_node_copies_data_and_schema_under_writes_on_every_node() -> Result<()> {
    mm_tests::init_tracing();
    let mut c = TestCluster::start(&["j1", "j2"], SCHEMA).await?;
    unversioned_part(&c, 0).await?;
    let rows = rows_to_load();
    load(&c, rows).await?;
    c.wait_sync(120).await?;

    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let mut writers = Vec::new();
    for i in 0..2 {
        let conn = c.pg[i].connect().await?;
        writers.push((i, tokio::spawn(writer(conn, i, 42, stop.clone()))));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    // A 3rd node, its database empty (the schema comes from the source),
    // from the node whose `part` rows have no version: on j3 they get the
    // oldest version there is...
    new_node(&mut c, "j3", "").await?;
    let took3 = add_newest(&c, &["--source", "j1"]).await?;
    let oldest = "SELECT count(*) FROM part \
                  WHERE pg_xact_commit_timestamp(xmin) = '1970-01-01 00:00:00+00'";
    let on_j3 = c.pg[2].query_one_string(oldest).await?;
    ensure!(
        on_j3.as_deref() == Some("1000"),
        "j3 has {on_j3:?} rows of the oldest version in part; j1 had 1000 without one"
    );
    // ... then a 4th from wherever is best, while all three write.
    let conn = c.pg[2].connect().await?;
    writers.push((2, tokio::spawn(writer(conn, 2, 42, stop.clone()))));
    new_node(&mut c, "j4", "").await?;
    let took4 = add_newest(&c, &[]).await?;

    // A little more writing with j4 in: its own writes reach everyone.
    tokio::time::sleep(Duration::from_secs(1)).await;
    c.pg[3]
        .execute(
            "INSERT INTO kv (id, v) SELECT g, 'from j4' FROM generate_series(90000001, 90000100) g",
        )
        .await?;
    stop_tx.send(true)?;
    let mut tallies = Vec::new();
    for (i, w) in writers {
        tallies.push((i, w.await??));
    }
    c.wait_sync(180).await?;
    let n = assert_converged(&c).await?;
    ensure!(
        n as i64 > rows - rows / 1000 - 1,
        "kv has {n} rows, fewer than loaded"
    );
    assert_each_once(&c, &tallies).await?;
    let from_j4 = c.pg[1]
        .query_one_string("SELECT count(*) FROM kv WHERE v = 'from j4'")
        .await?;
    ensure!(
        from_j4.as_deref() == Some("100"),
        "j4's rows on j2: {from_j4:?}"
    );
    // Identity values continue after the copied ones on the new node.
    c.pg[3]
        .execute("INSERT INTO ident (note) VALUES ('after')")
        .await?;
    let id = c.pg[3]
        .query_one_string("SELECT id FROM ident WHERE note = 'after'")
        .await?;
    ensure!(
        id.as_deref() == Some("501"),
        "identity on j4 restarted: {id:?}"
    );
    let writes: u64 = tallies.iter().map(|(_, t)| t.writes).sum();
    eprintln!(
        "e2e_join: {rows} rows, {writes} concurrent writes, add-node of j3 took {:.1} s, of j4 {:.1} s",
        took3.as_secs_f64(),
        took4.as_secs_f64()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn add_node_refuses_a_table_that_differs_until_it_is_fixed() -> Result<()> {
    mm_tests::init_tracing();
    let mut c = TestCluster::start(&["r1", "r2"], SCHEMA).await?;
    load(&c, 2000).await?;
    let wrong = SCHEMA.replace("n int NOT NULL DEFAULT 0", "n bigint NOT NULL DEFAULT 0");
    new_node(&mut c, "r3", &wrong).await?;
    let url = c.agents[2].url();
    let out = c
        .mmctl(0, &["add-node", "--name", "r3", "--url", &url])
        .await?;
    ensure!(!out.success(), "add-node accepted a different table");
    ensure!(
        out.stderr.contains("public.kv") && out.stderr.contains("n bigint"),
        "the refusal does not name the table and the difference: {}",
        out.stderr
    );
    // The others carry on meanwhile.
    c.pg[0]
        .execute("INSERT INTO kv (id, v) VALUES (-1, 'meanwhile')")
        .await?;
    c.wait_for(
        1,
        "SELECT count(*) FROM kv WHERE id = -1",
        "1",
        Duration::from_secs(30),
    )
    .await?;
    // Fixed: the same command finishes the join.
    c.pg[2]
        .execute("ALTER TABLE kv ALTER COLUMN n TYPE int")
        .await?;
    let out = c
        .mmctl(0, &["add-node", "--name", "r3", "--url", &url])
        .await?;
    ensure!(out.success(), "add-node after the fix: {}", out.stderr);
    c.wait_sync(120).await?;
    assert_converged(&c).await?;
    Ok(())
}

/// Waits until the new node (`c.pg[i]`) is copying rows.
async fn wait_copying(c: &TestCluster, i: usize) -> Result<()> {
    let conn = c.pg[i].connect().await?;
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let phase = conn
            .query_opt(
                "SELECT phase FROM mm.sync_state WHERE to_regclass('mm.sync_state') IS NOT NULL",
                &[],
            )
            .await
            .ok()
            .flatten()
            .map(|r| r.get::<_, String>(0));
        match phase.as_deref() {
            Some("copying") => return Ok(()),
            Some(other) => anyhow::bail!("the copy went to {other} before it could be interrupted"),
            None => {}
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "the copy never started"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// What is killed in the middle of the copy.
#[derive(Clone, Copy, PartialEq)]
enum Kill {
    /// mmctl and the new node's agent; then mmctl is run again.
    MmctlAndNewAgent,
    /// The source's agent (restarted a second later).
    SourceAgent,
}

/// A join from k2 into k4 under writes on k1..k3, interrupted by `kill`
/// in the middle of the copy: the same command finishes it, nothing lost,
/// nothing twice.
async fn interrupted_join(kill: Kill) -> Result<()> {
    mm_tests::init_tracing();
    let mut c = TestCluster::start(&["k1", "k2", "k3"], SCHEMA).await?;
    // Enough rows to be caught in the middle of the copy.
    load(&c, rows_to_load() * 2 / 5).await?;
    c.wait_sync(120).await?;
    new_node(&mut c, "k4", "").await?;
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let mut writers = Vec::new();
    for i in 0..3 {
        let conn = c.pg[i].connect().await?;
        writers.push((i, tokio::spawn(writer(conn, i, 7, stop.clone()))));
    }
    let url = c.agents[3].url();
    let args = ["add-node", "--name", "k4", "--url", &url, "--source", "k2"];
    let token = c.token_file();
    let mut first = mm_tests::agent::mmctl_child(&c.agents[0].url(), &token, &args)?;
    wait_copying(&c, 3).await?;
    let out = match kill {
        Kill::MmctlAndNewAgent => {
            first.kill().await?;
            c.agents[3].kill9()?;
            c.agents[3].start()?;
            c.agents[3].wait_ready(Duration::from_secs(30)).await?;
            tokio::time::timeout(Duration::from_secs(150), c.mmctl(0, &args)).await
        }
        Kill::SourceAgent => {
            c.agents[1].kill9()?;
            tokio::time::sleep(Duration::from_secs(1)).await;
            c.agents[1].start()?;
            c.agents[1].wait_ready(Duration::from_secs(30)).await?;
            // The first mmctl finishes, or says why; then it is run again.
            let status = tokio::time::timeout(Duration::from_secs(150), first.wait()).await;
            ensure!(
                status.is_ok(),
                "the interrupted add-node did not return in 150 s"
            );
            tokio::time::timeout(Duration::from_secs(150), c.mmctl(0, &args)).await
        }
    };
    let tail = |i: usize| {
        c.agents[i]
            .log()
            .lines()
            .filter(|l| !l.contains("DEBUG"))
            .rev()
            .take(30)
            .collect::<Vec<_>>()
            .join("\n")
    };
    let out = match out {
        Ok(r) => r?,
        Err(_) => {
            anyhow::bail!(
                "add-node after the interruption did not return in 150 s\n--- k4 (newest first) ---\n{}\n--- k1 ---\n{}",
                tail(3),
                tail(0)
            );
        }
    };
    ensure!(
        out.success(),
        "add-node after the interruption did not finish: {}\n--- k4 (newest first) ---\n{}\n--- k1 ---\n{}",
        out.stderr,
        tail(3),
        tail(0)
    );
    stop_tx.send(true)?;
    let mut tallies = Vec::new();
    for (i, w) in writers {
        tallies.push((i, w.await??));
    }
    c.wait_sync(180).await?;
    assert_converged(&c).await?;
    assert_each_once(&c, &tallies).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_whose_mmctl_and_new_agent_are_killed_finishes_when_run_again() -> Result<()> {
    interrupted_join(Kill::MmctlAndNewAgent).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_whose_source_agent_is_killed_finishes_without_loss_or_duplicates() -> Result<()> {
    interrupted_join(Kill::SourceAgent).await
}

/// The names of the cluster's nodes, from `mmctl status --json`.
async fn members(c: &TestCluster) -> Result<Vec<String>> {
    let out = c.mmctl(0, &["--json", "status"]).await?;
    let s = out.json()?;
    let mut names: Vec<String> = s["nodes"]
        .as_array()
        .context("status without nodes")?
        .iter()
        .filter_map(|n| n["name"].as_str().map(str::to_owned))
        .collect();
    names.sort();
    Ok(names)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn add_node_bad_input_is_one_clear_line_and_changes_nothing() -> Result<()> {
    mm_tests::init_tracing();
    let mut c = TestCluster::start(&["b1", "b2"], SCHEMA).await?;
    load(&c, 1000).await?;
    new_node(&mut c, "b3", "").await?;
    let url = c.agents[2].url();
    let before = members(&c).await?;
    let cases: [(&[&str], &[&str]); 4] = [
        // A name that is not the agent's (b1 is taken, too).
        (&["add-node", "--name", "b1", "--url", &url], &["b3", "b1"]),
        // Nothing listens there.
        (
            &["add-node", "--name", "b3", "--url", "http://127.0.0.1:9"],
            &["127.0.0.1:9"],
        ),
        // Not a URL at all.
        (
            &["add-node", "--name", "b3", "--url", "db3:5432"],
            &["db3:5432"],
        ),
        // A source that is not a node.
        (
            &[
                "add-node", "--name", "b3", "--url", &url, "--source", "nope",
            ],
            &["nope"],
        ),
    ];
    for (args, says) in cases {
        let out = c.mmctl(0, args).await?;
        ensure!(!out.success(), "{args:?} succeeded: {}", out.stdout);
        let lines: Vec<&str> = out
            .stderr
            .lines()
            .filter(|l| !l.trim().is_empty())
            .collect();
        ensure!(lines.len() == 1, "{args:?}: not one line: {:?}", out.stderr);
        for word in says {
            ensure!(
                lines[0].contains(word),
                "{args:?}: the error does not say {word:?}: {}",
                lines[0]
            );
        }
        ensure!(
            members(&c).await? == before,
            "{args:?} changed the membership"
        );
    }
    // Nothing was left half-done: the right command still works.
    let out = c
        .mmctl(0, &["add-node", "--name", "b3", "--url", &url])
        .await?;
    ensure!(out.success(), "add-node b3: {}", out.stderr);
    c.wait_sync(120).await?;
    assert_converged(&c).await?;
    Ok(())
}

/// A join that will not finish (its new agent killed mid-copy and gone for
/// good) is cleaned up by `remove-node`: the slots made for it are dropped
/// everywhere, the others keep replicating, status lists only them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remove_node_cleans_up_a_half_joined_node() -> Result<()> {
    mm_tests::init_tracing();
    let mut c = TestCluster::start(&["h1", "h2"], SCHEMA).await?;
    load(&c, rows_to_load() * 2 / 5).await?;
    c.wait_sync(120).await?;
    new_node(&mut c, "h3", "").await?;
    let url = c.agents[2].url();
    let token = c.token_file();
    let mut join = mm_tests::agent::mmctl_child(
        &c.agents[0].url(),
        &token,
        &["add-node", "--name", "h3", "--url", &url],
    )?;
    wait_copying(&c, 2).await?;
    join.kill().await?;
    c.agents[2].kill9()?;

    let out = c.mmctl(0, &["remove-node", "--name", "h3"]).await?;
    ensure!(out.success(), "remove-node h3: {}", out.stderr);
    ensure!(
        members(&c).await? == ["h1", "h2"],
        "status after the removal: {:?}",
        members(&c).await?
    );
    for i in 0..2 {
        let mut left = None;
        for _ in 0..100 {
            left = c.pg[i]
                .query_one_string(
                    "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE '%h3%'",
                )
                .await?;
            if left.as_deref() == Some("0") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        ensure!(
            left.as_deref() == Some("0"),
            "{} still has {left:?} slots for h3",
            c.pg[i].name()
        );
    }
    c.pg[1]
        .execute("INSERT INTO kv (id, v) VALUES (-5, 'after the removal')")
        .await?;
    c.wait_for(
        0,
        "SELECT count(*) FROM kv WHERE id = -5",
        "1",
        Duration::from_secs(30),
    )
    .await?;
    Ok(())
}
