//! Backlog catch-up: apply *capacity*, not the driver's speed.
//!
//! With the stream running, a subscriber that keeps pace with the load
//! generator measures the generator. Here the stream into node b is stopped
//! first (native: `ALTER SUBSCRIPTION .. DISABLE`, mm: `mmctl pause`), the
//! whole workload is committed on node a, and only then is the stream
//! started again: the time until b has everything is what the applier needs
//! for that backlog, decoding included. The same shapes run on both systems,
//! minutes apart, in one run.
//!
//! Resources are sampled from /proc meanwhile (every 50 ms): the agent process (mm), the
//! subscriber's apply backends (mm: the agent's sessions; native: the apply
//! worker and its parallel workers) and the publisher's walsender.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::{Kind, System};

/// The shapes of the backlog workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// Single-row INSERT transactions.
    Insert1,
    /// Single-row UPDATE transactions over a preloaded table.
    Update1,
    /// Single-row DELETE transactions over a preloaded table.
    Delete1,
    /// INSERT transactions of 1000 rows each.
    Insert1000,
    /// One INSERT transaction (200k rows by default).
    OneTxn,
    /// One INSERT transaction bigger than `logical_decoding_work_mem`
    /// (1M rows by default): streamed before its commit.
    Streamed,
}

impl Shape {
    pub const ALL: [Shape; 6] = [
        Shape::Insert1,
        Shape::Update1,
        Shape::Delete1,
        Shape::Insert1000,
        Shape::OneTxn,
        Shape::Streamed,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Shape::Insert1 => "single-row INSERT txns",
            Shape::Update1 => "single-row UPDATE txns",
            Shape::Delete1 => "single-row DELETE txns",
            Shape::Insert1000 => "1000-row INSERT txns",
            Shape::OneTxn => "one INSERT txn",
            Shape::Streamed => "one streamed INSERT txn",
        }
    }

    pub fn key(self) -> &'static str {
        match self {
            Shape::Insert1 => "ins1",
            Shape::Update1 => "upd1",
            Shape::Delete1 => "del1",
            Shape::Insert1000 => "ins1000",
            Shape::OneTxn => "one",
            Shape::Streamed => "streamed",
        }
    }

    pub fn parse(s: &str) -> Option<Shape> {
        Shape::ALL.into_iter().find(|k| k.key() == s)
    }

    /// Its own table, so that shapes never see each other's rows.
    fn table(self) -> &'static str {
        match self {
            Shape::Insert1 => "bl_ins1",
            Shape::Update1 => "bl_upd1",
            Shape::Delete1 => "bl_del1",
            Shape::Insert1000 => "bl_ins1000",
            Shape::OneTxn => "bl_one",
            Shape::Streamed => "bl_streamed",
        }
    }
}

/// The backlog tables, created with the rest of the bench schema.
pub const SCHEMA: &str = "
CREATE TABLE bl_ins1 (id bigint PRIMARY KEY, n bigint NOT NULL, v text NOT NULL);
CREATE TABLE bl_upd1 (id bigint PRIMARY KEY, n bigint NOT NULL, v text NOT NULL);
CREATE TABLE bl_del1 (id bigint PRIMARY KEY, n bigint NOT NULL, v text NOT NULL);
CREATE TABLE bl_ins1000 (id bigint PRIMARY KEY, n bigint NOT NULL, v text NOT NULL);
CREATE TABLE bl_one (id bigint PRIMARY KEY, n bigint NOT NULL, v text NOT NULL);
CREATE TABLE bl_streamed (id bigint PRIMARY KEY, n bigint NOT NULL, v text NOT NULL);
";

/// CPU seconds and memory of the processes involved in one catch-up.
#[derive(Debug, Clone, Copy, Default)]
pub struct Resources {
    /// mm-agent on the subscriber (0 for native).
    pub agent_cpu: f64,
    /// Peak resident set of the subscriber's agent, bytes (0 for native).
    pub agent_peak_rss: u64,
    /// The subscriber's apply backends.
    pub apply_cpu: f64,
    /// The publisher's walsender(s) for this stream.
    pub walsender_cpu: f64,
}

/// One backlog measurement.
#[derive(Debug, Clone, Copy)]
pub struct Backlog {
    pub shape: Shape,
    pub rows: u64,
    pub txns: u64,
    /// Committing the backlog on the publisher (not part of the result).
    pub load: Duration,
    /// From the restart of the stream until the subscriber had everything.
    pub catch_up: Duration,
    pub res: Resources,
}

impl Backlog {
    pub fn rows_per_sec(&self) -> f64 {
        self.rows as f64 / self.catch_up.as_secs_f64().max(1e-9)
    }
}

/// Rows of each shape. Single-row shapes use `rows` transactions.
#[derive(Debug, Clone, Copy)]
pub struct BacklogConfig {
    pub rows: u64,
    pub batch_rows: u64,
    pub one_txn_rows: u64,
    pub streamed_rows: u64,
}

/// Runs one shape on one system: preload (replicated, settled), stop the
/// stream a → b, commit the backlog on a, start the stream, time b.
pub async fn run(sys: &System, shape: Shape, cfg: &BacklogConfig) -> Result<Backlog> {
    let table = shape.table();
    let rows = match shape {
        Shape::Insert1 | Shape::Update1 | Shape::Delete1 => cfg.rows,
        Shape::Insert1000 => cfg.batch_rows,
        Shape::OneTxn => cfg.one_txn_rows,
        Shape::Streamed => cfg.streamed_rows,
    };
    if matches!(shape, Shape::Update1 | Shape::Delete1) {
        sys.a()
            .execute(&format!(
                "INSERT INTO {table} (id, n, v) SELECT g, 0, md5(g::text) FROM generate_series(1, {rows}) g"
            ))
            .await?;
        sys.settle().await?;
    }
    stop_stream(sys).await?;
    let a = sys.a().connect().await?;
    a.batch_execute("SET synchronous_commit = off").await?;
    let t = Instant::now();
    let txns = match shape {
        Shape::Insert1 | Shape::Update1 | Shape::Delete1 => {
            let sql = match shape {
                Shape::Insert1 => format!(
                    "INSERT INTO {table} (id, n, v) VALUES ($1::bigint, $1::bigint, md5($1::bigint::text))"
                ),
                Shape::Update1 => format!("UPDATE {table} SET n = n + 1 WHERE id = $1::bigint"),
                _ => format!("DELETE FROM {table} WHERE id = $1::bigint"),
            };
            // Committed before the stream starts: the driver's speed is
            // not part of the result.
            let conns = super::open_clients(sys.a(), 4, false, &sql).await?;
            super::drive(conns, rows).await?;
            rows
        }
        Shape::Insert1000 => {
            let mut lo = 1u64;
            let mut n = 0;
            while lo <= rows {
                let hi = (lo + 999).min(rows);
                a.batch_execute(&format!(
                    "INSERT INTO {table} (id, n, v) SELECT g, g, md5(g::text) FROM generate_series({lo}, {hi}) g"
                ))
                .await?;
                lo = hi + 1;
                n += 1;
            }
            n
        }
        Shape::OneTxn | Shape::Streamed => {
            a.batch_execute(&format!(
                "INSERT INTO {table} (id, n, v) SELECT g, g, md5(g::text) FROM generate_series(1, {rows}) g"
            ))
            .await?;
            1
        }
    };
    let load = t.elapsed();
    sys.checkpoint().await?;
    let (check, want) = match shape {
        Shape::Update1 => (
            format!("SELECT sum(n)::bigint FROM {table}"),
            rows.to_string(),
        ),
        Shape::Delete1 => (format!("SELECT count(*) FROM {table}"), "0".to_owned()),
        _ => (format!("SELECT count(*) FROM {table}"), rows.to_string()),
    };
    let sampler = Sampler::start(sys).await?;
    let start = Instant::now();
    start_stream(sys).await?;
    let catch_up = sys.delivered(start, &check, &want).await?;
    let res = sampler.stop().await?;
    Ok(Backlog {
        shape,
        rows,
        txns,
        load,
        catch_up,
        res,
    })
}

/// Stops a → b and waits until nothing applies any more.
async fn stop_stream(sys: &System) -> Result<()> {
    match sys.kind {
        Kind::Native => {
            let sub = native_sub(sys);
            sys.b()
                .execute(&format!("ALTER SUBSCRIPTION {sub} DISABLE"))
                .await?;
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let n = sys
                    .b()
                    .query_one_string(&format!(
                        "SELECT count(*) FROM pg_stat_subscription WHERE subname = '{sub}' AND pid IS NOT NULL"
                    ))
                    .await?;
                if n.as_deref() == Some("0") {
                    return Ok(());
                }
                if Instant::now() > deadline {
                    bail!("native: {sub}'s apply worker did not stop");
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Kind::Mm => {
            let (from, to) = (sys.a().name().to_owned(), sys.b().name().to_owned());
            sys.mmctl(&["pause", "--from", &from, "--to", &to]).await?;
            Ok(())
        }
    }
}

async fn start_stream(sys: &System) -> Result<()> {
    match sys.kind {
        Kind::Native => {
            let sub = native_sub(sys);
            sys.b()
                .execute(&format!("ALTER SUBSCRIPTION {sub} ENABLE"))
                .await
        }
        Kind::Mm => {
            let (from, to) = (sys.a().name().to_owned(), sys.b().name().to_owned());
            sys.mmctl(&["resume", "--from", &from, "--to", &to])
                .await
                .map(|_| ())
        }
    }
}

/// b's subscription to a (see `System::native`).
fn native_sub(sys: &System) -> String {
    format!("s_from_{}", sys.a().name().replace('-', "_"))
}

/// Samples CPU time and RSS of the processes of one catch-up every 50 ms.
struct Sampler {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Result<Resources>>,
}

/// The subscriber's apply backends: native's apply worker and its parallel
/// workers, or the agent's sessions.
fn apply_pids_sql(kind: Kind, sub: &str) -> String {
    match kind {
        Kind::Native => format!(
            "SELECT pid::text FROM pg_stat_subscription WHERE subname = '{sub}' AND pid IS NOT NULL"
        ),
        Kind::Mm => "SELECT pid::text FROM pg_stat_activity WHERE application_name = 'mm-agent' \
                     AND pid <> pg_backend_pid()"
            .to_owned(),
    }
}

/// (utime + stime, start time) of a process, both in seconds since boot
/// (clock ticks of 100 Hz, Linux's USER_HZ).
fn cpu_and_start(pid: u32) -> Option<(f64, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command may contain spaces: fields count from after its ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    let start: u64 = f.get(19)?.parse().ok()?;
    Some((ticks as f64 / 100.0, start as f64 / 100.0))
}

/// Seconds since boot, as /proc/<pid>/stat's start times count.
fn uptime() -> f64 {
    std::fs::read_to_string("/proc/uptime")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

/// CPU used by a changing set of processes during the sampled window: for
/// each pid its last reading minus its first, or all of it when the process
/// started inside the window (native's apply worker starts at ENABLE).
struct CpuSum {
    since: f64,
    first: HashMap<u32, f64>,
    last: HashMap<u32, f64>,
}

impl CpuSum {
    fn new(since: f64) -> Self {
        CpuSum {
            since,
            first: HashMap::new(),
            last: HashMap::new(),
        }
    }

    fn observe(&mut self, pids: &[u32]) {
        for &p in pids {
            if let Some((c, started)) = cpu_and_start(p) {
                let base = if started >= self.since { 0.0 } else { c };
                self.first.entry(p).or_insert(base);
                self.last.insert(p, c);
            }
        }
    }

    fn total(&self) -> f64 {
        let sum: f64 = self
            .last
            .iter()
            .map(|(p, l)| l - self.first.get(p).copied().unwrap_or(*l))
            .sum();
        // Not -0.0 (the sum of nothing) in the report.
        if sum > 0.0 { sum } else { 0.0 }
    }
}

impl Sampler {
    async fn start(sys: &System) -> Result<Sampler> {
        let stop = Arc::new(AtomicBool::new(false));
        // The processes that count: the subscriber's agent, its apply
        // backends and the publisher's walsenders; the last two are found
        // again every round (parallel apply workers and walsenders come and
        // go), over a connection per node owned by the task.
        let agent: Vec<u32> = match sys.kind {
            Kind::Native => Vec::new(),
            Kind::Mm => sys
                .agents()
                .get(1)
                .and_then(|a| a.pid())
                .into_iter()
                .collect(),
        };
        let b = sys.b().connect().await?;
        let a = sys.a().connect().await?;
        let kind = sys.kind;
        let sub = native_sub(sys);
        let apply_sql = apply_pids_sql(kind, &sub);
        let wal_sql = "SELECT pid::text FROM pg_stat_replication";
        let apply = simple_pids(&b, &apply_sql).await?;
        let wal = simple_pids(&a, wal_sql).await?;
        let flag = Arc::clone(&stop);
        let task = tokio::spawn(async move {
            let since = uptime();
            let (mut ag, mut ap, mut ws) =
                (CpuSum::new(since), CpuSum::new(since), CpuSum::new(since));
            let (mut apply, mut wal) = (apply, wal);
            let mut peak = 0u64;
            loop {
                ag.observe(&agent);
                ap.observe(&apply);
                ws.observe(&wal);
                for &p in &agent {
                    peak = peak.max(rss_bytes(p).unwrap_or(0));
                }
                if flag.load(Ordering::Relaxed) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                // Every round: a catch-up may last less than 100 ms.
                apply = simple_pids(&b, &apply_sql).await.unwrap_or(apply);
                wal = simple_pids(&a, wal_sql).await.unwrap_or(wal);
            }
            Ok(Resources {
                agent_cpu: ag.total(),
                agent_peak_rss: peak,
                apply_cpu: ap.total(),
                walsender_cpu: ws.total(),
            })
        });
        Ok(Sampler { stop, task })
    }

    async fn stop(self) -> Result<Resources> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.context("resource sampler")?
    }
}

async fn simple_pids(c: &tokio_postgres::Client, sql: &str) -> Result<Vec<u32>> {
    let mut out = Vec::new();
    for m in c.simple_query(sql).await? {
        if let tokio_postgres::SimpleQueryMessage::Row(r) = m
            && let Some(p) = r.get(0).and_then(|s| s.parse().ok())
        {
            out.push(p);
        }
    }
    Ok(out)
}
