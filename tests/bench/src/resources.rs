//! CPU seconds and memory of the processes one measurement involves,
//! sampled from /proc every 50 ms while it runs: the subscriber's agent
//! (mm), the subscriber's apply backends (mm: the agent's sessions; native:
//! the apply worker and its parallel workers) and the publisher's
//! walsenders; apart, the other direction's (the subscriber's walsenders,
//! the publisher's agent and apply backends); and the whole machine's busy
//! cores. Shared by the live workloads and the backlog catch-up.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};

use super::{Kind, System};

/// CPU seconds and memory of the processes involved in one measurement.
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
    /// The other direction, which a two-way system runs while it applies:
    /// the subscriber's walsenders (decoding every applied row only to drop
    /// it by origin), the publisher's agent (mm) and apply backends. They
    /// share the machine's cores with the stream measured.
    pub reverse_cpu: f64,
    /// Cores the whole machine kept busy on average over the window (from
    /// /proc/stat): near the core count, the run was bound by CPU, and its
    /// ratio is one of CPU per row, not of waiting.
    pub busy_cores: f64,
}

/// b's subscription to a (see `System::native`).
pub(crate) fn native_sub(sys: &System) -> String {
    format!("s_from_{}", sys.a().name().replace('-', "_"))
}

/// a's subscription to b: the other direction.
fn native_reverse_sub(sys: &System) -> String {
    format!("s_from_{}", sys.b().name().replace('-', "_"))
}

/// Samples CPU time and RSS of the processes of one measurement every 50 ms.
pub(crate) struct Sampler {
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

/// (busy, total) jiffies of all CPUs together since boot: busy is all but
/// idle and iowait.
fn machine_jiffies() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let cpu = stat.lines().next()?.strip_prefix("cpu ")?;
    let f: Vec<u64> = cpu
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    let total: u64 = f.iter().take(8).sum();
    let idle = f.get(3)? + f.get(4)?;
    Some((total - idle, total))
}

/// Average busy cores between two `machine_jiffies` readings.
fn busy_cores(start: Option<(u64, u64)>, end: Option<(u64, u64)>) -> f64 {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    match (start, end) {
        (Some((b0, t0)), Some((b1, t1))) if t1 > t0 => {
            (b1.saturating_sub(b0)) as f64 / (t1 - t0) as f64 * cores
        }
        _ => 0.0,
    }
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
    pub(crate) async fn start(sys: &System) -> Result<Sampler> {
        let stop = Arc::new(AtomicBool::new(false));
        // The processes that count: the subscriber's agent, its apply
        // backends and the publisher's walsenders; the last two are found
        // again every round (parallel apply workers and walsenders come and
        // go), over a connection per node owned by the task.
        let agent_pid = |i: usize| -> Vec<u32> {
            match sys.kind {
                Kind::Native => Vec::new(),
                Kind::Mm => sys
                    .agents()
                    .get(i)
                    .and_then(|a| a.pid())
                    .into_iter()
                    .collect(),
            }
        };
        let (agent, rev_agent) = (agent_pid(1), agent_pid(0));
        let b = sys.b().connect().await?;
        let a = sys.a().connect().await?;
        let kind = sys.kind;
        let sub = native_sub(sys);
        let apply_sql = apply_pids_sql(kind, &sub);
        let rev_apply_sql = apply_pids_sql(kind, &native_reverse_sub(sys));
        let wal_sql = "SELECT pid::text FROM pg_stat_replication";
        let apply = simple_pids(&b, &apply_sql).await?;
        let wal = simple_pids(&a, wal_sql).await?;
        let rev = reverse_pids(&a, &b, &rev_apply_sql, &rev_agent).await?;
        let flag = Arc::clone(&stop);
        let task = tokio::spawn(async move {
            let since = uptime();
            let machine_start = machine_jiffies();
            let (mut ag, mut ap, mut ws, mut rv) = (
                CpuSum::new(since),
                CpuSum::new(since),
                CpuSum::new(since),
                CpuSum::new(since),
            );
            let (mut apply, mut wal, mut rev) = (apply, wal, rev);
            let mut peak = 0u64;
            loop {
                ag.observe(&agent);
                ap.observe(&apply);
                ws.observe(&wal);
                rv.observe(&rev);
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
                rev = reverse_pids(&a, &b, &rev_apply_sql, &rev_agent)
                    .await
                    .unwrap_or(rev);
            }
            Ok(Resources {
                agent_cpu: ag.total(),
                agent_peak_rss: peak,
                apply_cpu: ap.total(),
                walsender_cpu: ws.total(),
                reverse_cpu: rv.total(),
                busy_cores: busy_cores(machine_start, machine_jiffies()),
            })
        });
        Ok(Sampler { stop, task })
    }

    pub(crate) async fn stop(self) -> Result<Resources> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.context("resource sampler")?
    }
}

/// The other direction's processes: b's walsenders, a's apply backends and
/// a's agent.
async fn reverse_pids(
    a: &tokio_postgres::Client,
    b: &tokio_postgres::Client,
    apply_sql: &str,
    agent: &[u32],
) -> Result<Vec<u32>> {
    let mut pids = simple_pids(b, "SELECT pid::text FROM pg_stat_replication").await?;
    pids.extend(simple_pids(a, apply_sql).await?);
    pids.extend_from_slice(agent);
    Ok(pids)
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
