//! add-node's initial copy against `pg_dump | psql`, same machine, same run.
//!
//!   join-bench [--rows N] [--versions K] [--load R]
//!
//! One source node holds a table of N rows loaded in one transaction, then
//! K single-row updates (K more row versions for the copy to keep). Native:
//! `pg_dump | psql` of the table into an empty database. mm: `mmctl
//! add-node` of a node with an empty database (schema and rows copied),
//! until it is active. Prints both times and native/mm (>= 1 means mm is
//! at least as fast). With `--load R` the cluster has two nodes, each
//! taking R single-row write transactions a second throughout the join
//! (the join must finish without one of them failing, and every node ends
//! identical). Run through `scripts/bench.sh join`.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use mm_tests::{AgentProcess, PgNode, PgOptions, TestCluster, pg_bin_dir};

const SCHEMA: &str = "CREATE TABLE items (id bigint PRIMARY KEY, v text NOT NULL, pad text NOT NULL, n int NOT NULL DEFAULT 0)";

struct Args {
    rows: i64,
    versions: i64,
    /// Write transactions per second per existing node during the join.
    load: u64,
}

fn args() -> Result<Args> {
    let mut a = Args {
        rows: 500_000,
        versions: 0,
        load: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut num = || -> Result<i64> {
            it.next()
                .with_context(|| format!("{flag} needs a value"))?
                .parse()
                .with_context(|| format!("{flag} takes a number"))
        };
        match flag.as_str() {
            "--rows" => a.rows = num()?.max(1),
            "--versions" => a.versions = num()?.max(0),
            "--load" => a.load = num()?.max(0) as u64,
            "-h" | "--help" => {
                println!("join-bench [--rows N] [--versions K] [--load TXN_PER_S]");
                std::process::exit(0);
            }
            other => bail!("unknown flag {other}"),
        }
    }
    Ok(a)
}

async fn load(pg: &PgNode, a: &Args) -> Result<()> {
    pg.execute(&format!(
        "INSERT INTO items SELECT g, 'v' || g, repeat(md5(g::text), 3) FROM generate_series(1, {}) g",
        a.rows
    ))
    .await?;
    let c = pg.connect().await?;
    for i in 0..a.versions {
        c.batch_execute(&format!(
            "UPDATE items SET n = n + 1 WHERE id = {}",
            1 + (i * 7919) % a.rows
        ))
        .await?;
    }
    pg.execute("CHECKPOINT").await?;
    Ok(())
}

async fn native(a: &Args) -> Result<Duration> {
    let src = PgNode::start_with("jbn1", PgOptions::default())?;
    let dst = PgNode::start_with("jbn2", PgOptions::default())?;
    src.execute(SCHEMA).await?;
    load(&src, a).await?;
    let bin = pg_bin_dir()?;
    let pw = src.password().map(str::to_owned);
    let script = format!(
        "set -o pipefail; '{}/pg_dump' --no-owner --no-privileges -t public.items --dbname '{}' | '{}/psql' -q -X -v ON_ERROR_STOP=1 --dbname '{}' >/dev/null",
        bin.display(),
        src.dsn(),
        bin.display(),
        dst.dsn()
    );
    let mut cmd = std::process::Command::new("bash");
    cmd.arg("-c").arg(&script);
    if let Some(p) = &pw {
        cmd.env("PGPASSWORD", p);
    }
    let t = Instant::now();
    let status = cmd.status()?;
    let took = t.elapsed();
    ensure!(status.success(), "pg_dump | psql failed");
    let n = dst.query_one_string("SELECT count(*) FROM items").await?;
    ensure!(n == Some(a.rows.to_string()), "native copied {n:?} rows");
    Ok(took)
}

/// Paced single-row writes on one node until `stop`: (transactions done,
/// failures).
async fn paced(
    conn: tokio_postgres::Client,
    node: usize,
    rate: u64,
    stop: tokio::sync::watch::Receiver<bool>,
) -> (u64, u64) {
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate as f64));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let (mut done, mut failed) = (0u64, 0u64);
    let base = 1_000_000_000 * (node as i64 + 1);
    while !*stop.borrow() {
        tick.tick().await;
        let sql = if done % 2 == 0 {
            format!(
                "INSERT INTO items VALUES ({}, 'live', 'x', 0)",
                base + done as i64
            )
        } else {
            format!(
                "UPDATE items SET n = n + 1 WHERE id = {}",
                1 + (done as i64 * 104_729) % 1000
            )
        };
        match conn.batch_execute(&sql).await {
            Ok(()) => done += 1,
            Err(e) => {
                failed += 1;
                eprintln!("load on node {node}: {e}");
            }
        }
    }
    (done, failed)
}

async fn mm(a: &Args) -> Result<Duration> {
    let names: &[&str] = if a.load > 0 {
        &["jbm1", "jbm1b"]
    } else {
        &["jbm1"]
    };
    let mut c = TestCluster::start(names, SCHEMA).await?;
    load(&c.pg[0], a).await?;
    if a.load > 0 {
        c.wait_sync(300).await?;
    }
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let mut writers = Vec::new();
    if a.load > 0 {
        for i in 0..c.pg.len() {
            let conn = c.pg[i].connect().await?;
            writers.push(tokio::spawn(paced(conn, i, a.load, stop.clone())));
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let pg = PgNode::start_with("jbm2", PgOptions::default())?;
    let mut agent = AgentProcess::spawn("jbm2", &pg, &c.secrets)?;
    agent.wait_ready(Duration::from_secs(30)).await?;
    let url = agent.url();
    c.pg.push(pg);
    c.agents.push(agent);
    let t = Instant::now();
    let out = c
        .mmctl(0, &["add-node", "--name", "jbm2", "--url", &url])
        .await?;
    let took = t.elapsed();
    ensure!(out.success(), "add-node failed: {}", out.stderr);
    if a.load > 0 {
        stop_tx.send(true)?;
        let secs = t.elapsed().as_secs_f64() + 2.0;
        for (i, w) in writers.into_iter().enumerate() {
            let (done, failed) = w.await?;
            println!(
                "load on {}: {done} write transactions ({:.0}/s asked {}), {failed} failed",
                names[i],
                done as f64 / secs,
                a.load
            );
            ensure!(
                failed == 0,
                "the load failed {failed} times during the join"
            );
        }
        c.wait_sync(300).await?;
        c.assert_same("SELECT id, v, n FROM items ORDER BY id")
            .await?;
    }
    let new = c.pg.len() - 1;
    for line in c.agents[new].log().lines() {
        if line.contains("add-node") && !line.contains("DEBUG") {
            eprintln!("{line}");
        }
    }
    let n = c.pg[new]
        .query_one_string("SELECT count(*) FROM items WHERE id < 1000000000")
        .await?;
    ensure!(n == Some(a.rows.to_string()), "mm copied {n:?} rows");
    c.assert_same(
        "SELECT id, n, pg_xact_commit_timestamp(xmin)::text FROM items WHERE n > 0 ORDER BY id",
    )
    .await?;
    Ok(took)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let a = args()?;
    let n = native(&a).await?;
    let m = mm(&a).await?;
    println!(
        "initial copy of {} rows ({} extra row versions, load {} txn/s per node): pg_dump|psql {:.2} s, mm add-node {:.2} s, native/mm {:.2}",
        a.rows,
        a.versions,
        a.load,
        n.as_secs_f64(),
        m.as_secs_f64(),
        n.as_secs_f64() / m.as_secs_f64()
    );
    Ok(())
}
