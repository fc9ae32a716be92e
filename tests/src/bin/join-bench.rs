//! add-node's initial copy against `pg_dump | psql`, same machine, same run.
//!
//!   join-bench [--rows N] [--versions K]
//!
//! One source node holds a table of N rows loaded in one transaction, then
//! K single-row updates (K more row versions for the copy to keep). Native:
//! `pg_dump | psql` of the table into an empty database. mm: `mmctl
//! add-node` of a node with an empty database (schema and rows copied),
//! until it is active. Prints both times and native/mm (>= 1 means mm is
//! at least as fast). Run through `scripts/bench.sh join`.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use mm_tests::{AgentProcess, PgNode, PgOptions, TestCluster, pg_bin_dir};

const SCHEMA: &str = "CREATE TABLE items (id bigint PRIMARY KEY, v text NOT NULL, pad text NOT NULL, n int NOT NULL DEFAULT 0)";

struct Args {
    rows: i64,
    versions: i64,
}

fn args() -> Result<Args> {
    let mut a = Args {
        rows: 500_000,
        versions: 0,
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
            "-h" | "--help" => {
                println!("join-bench [--rows N] [--versions K]");
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

async fn mm(a: &Args) -> Result<Duration> {
    let mut c = TestCluster::start(&["jbm1"], SCHEMA).await?;
    load(&c.pg[0], a).await?;
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
    for line in c.agents[1].log().lines() {
        if line.contains("add-node") && !line.contains("DEBUG") {
            eprintln!("{line}");
        }
    }
    let n = c.pg[1]
        .query_one_string("SELECT count(*) FROM items")
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
        "initial copy of {} rows ({} extra row versions): pg_dump|psql {:.2} s, mm add-node {:.2} s, native/mm {:.2}",
        a.rows,
        a.versions,
        n.as_secs_f64(),
        m.as_secs_f64(),
        n.as_secs_f64() / m.as_secs_f64()
    );
    Ok(())
}
