//! mm-bench: mm against PostgreSQL's native logical replication, side by side
//! in one run on one machine with the same PostgreSQL build, reported as
//! ratios mm/native (the absolute numbers of a shared, noisy machine mean
//! little; the ratio of two systems measured minutes apart means more).
//!
//!   mm-bench [--quick] [--rows N] [--clients N] [--only 1,2,3,4,5] ...
//!   mm-bench conflicts              # only workload 5, the conflicts run
//!
//! Every flag also reads an environment default, `MM_BENCH_<FLAG>` (e.g.
//! `MM_BENCH_ROWS=50000`). `scripts/bench.sh` builds release binaries and
//! runs this with the release mm-agent/mmctl.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use mm_bench::backlog::{self, Backlog, BacklogConfig, Shape};
use mm_bench::{
    self as bench, ConflictConfig, ConflictResult, KeySet, Kind, Measured, Resources, System,
    TpcbConfig, TpcbResult, percentile,
};

const USAGE: &str = "\
mm-bench: mm vs PostgreSQL native logical replication (2 nodes each)

Workloads: 1 single-row INSERT txns, 2 one big INSERT txn, 3 single-row UPDATE txns
(all on node A), 4 TPC-B-like on both nodes with lag, 5 conflicts: single-row UPDATE
txns on both nodes at once, on disjoint keys (baseline) and on a hot key set
(conflict rate, divergence), 6 backlog catch-up (apply capacity): the stream into B
is stopped (native: DISABLE the subscription, mm: mmctl pause), the backlog is
committed on A, the stream started again and timed until B has everything, for each
shape. `mm-bench conflicts` = `--only 5`, `mm-bench backlog` = `--only 6`.

  --quick              small smoke run (~1 minute): 10k rows, 5 s TPC-B, 1000 conflict txns
  --rows N             rows / transactions of workloads 1-3 (default 200000)
  --clients N          publisher connections driving workloads 1 and 3 (default 4)
  --sync-commit on|off synchronous_commit of those connections (default off: the
                       publisher's fsyncs must not be what is measured)
  --only LIST          workloads to run, e.g. 1,3 or 5 or conflicts (default 1,2,3,4,5)
  --systems LIST       native,mm (default both; one alone is for profiling)
  --tpcb-seconds S     duration of the bidirectional TPC-B-like run (default 25)
  --tpcb-rate R[,R..]  pgbench -R per node, transactions/s, one run each; 0 = unthrottled
                       (default 100,300: comfortable, and near this 2-core box's limit)
  --tpcb-clients N     pgbench clients per node (default 2)
  --accounts N         accounts per node for TPC-B (default 100000 = pgbench scale 1)
  --heartbeat-ms MS    heartbeat period on each node (default 100)
  --sample-ms MS       lag sampling period on each node, jittered ±50% (default 10:
                       at 100 the sampling step would swamp lags of a few ms)
  --idle-seconds S     heartbeat-only sampling before the load: the method's floor (default 3)
  --agent-log FILTER   MM_LOG of the agents (default info; debug logs every transaction)
  --conflict-clients N connections per node in workload 5 (default 2)
  --conflict-txns N    single-row UPDATE txns per connection in workload 5 (default 5000)
  --conflict-keys N    keys per node of the disjoint run (default 1000)
  --hot-keys N         keys both nodes update in the hot run (default 100)
  --conflict-heartbeat-ms MS  heartbeat period on each node in workload 5 (default 20: the
                       runs last seconds, so lag needs more heartbeats than TPC-B's)
  --backlog-shapes LIST  shapes of workload 6 (default all): ins1, upd1, del1 (single-row
                       txns), updins (an UPDATE and an INSERT on two tables per txn),
                       ins1000 (1000-row txns), one (one txn), streamed (one txn
                       larger than logical_decoding_work_mem, streamed before commit)
  --backlog-rows N     transactions of the single-row and updins shapes (default 50000)
  --backlog-batch-rows N  rows of the 1000-row-txn shape (default 200000)
  --backlog-one-rows N rows of the one-txn shape (default 200000)
  --backlog-streamed-rows N  rows of the streamed shape (default 1000000)
  --backlog-repeat N   runs of each shape per system (default 1), native and mm taking
                       turns to go first; the table shows median rates and the median
                       and range of the per-pair ratios (this machine's weather moves
                       single runs by +-30%)

Every flag has an environment default MM_BENCH_<FLAG> (MM_BENCH_ROWS, MM_BENCH_QUICK=1, ...).
Agent binaries: MM_AGENT_BIN / MMCTL_BIN, else next to this executable.
";

#[derive(Debug, Clone)]
struct Args {
    rows: u64,
    clients: usize,
    sync_commit: bool,
    only: Vec<u8>,
    systems: Vec<Kind>,
    tpcb_seconds: u64,
    tpcb_rates: Vec<u64>,
    tpcb_clients: usize,
    accounts: u64,
    heartbeat_ms: u64,
    sample_ms: u64,
    idle_seconds: u64,
    agent_log: String,
    conflict_clients: usize,
    conflict_txns: u64,
    conflict_keys: u64,
    hot_keys: u64,
    conflict_heartbeat_ms: u64,
    backlog_shapes: Vec<Shape>,
    backlog: BacklogConfig,
    backlog_repeat: usize,
    quick: bool,
}

const FLAGS: &[&str] = &[
    "rows",
    "clients",
    "sync-commit",
    "only",
    "systems",
    "tpcb-seconds",
    "tpcb-rate",
    "tpcb-clients",
    "accounts",
    "heartbeat-ms",
    "sample-ms",
    "idle-seconds",
    "agent-log",
    "conflict-clients",
    "conflict-txns",
    "conflict-keys",
    "hot-keys",
    "conflict-heartbeat-ms",
    "backlog-shapes",
    "backlog-rows",
    "backlog-batch-rows",
    "backlog-one-rows",
    "backlog-streamed-rows",
    "backlog-repeat",
];

/// Workload numbers by name, for `--only` and bare arguments.
fn workload_number(s: &str) -> Option<u8> {
    match s {
        "conflicts" => Some(5),
        "backlog" => Some(6),
        _ => match s.parse::<u8>() {
            Ok(n @ 1..=6) => Some(n),
            _ => None,
        },
    }
}

fn env_name(flag: &str) -> String {
    format!("MM_BENCH_{}", flag.replace('-', "_").to_ascii_uppercase())
}

fn parse_args() -> Result<Option<Args>> {
    // Flags override environment defaults; --quick only changes defaults, so
    // `--quick --rows 5000` means a quick run with 5000 rows.
    let mut given: Vec<(String, String)> = Vec::new();
    for f in FLAGS {
        if let Ok(v) = std::env::var(env_name(f)) {
            given.push(((*f).to_owned(), v));
        }
    }
    let mut quick = std::env::var("MM_BENCH_QUICK").is_ok_and(|v| v == "1" || v == "true");
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "-h" | "--help" => {
                print!("{USAGE}");
                return Ok(None);
            }
            "--quick" => quick = true,
            a => {
                let Some(name) = a.strip_prefix("--") else {
                    // A bare workload name: `mm-bench conflicts`.
                    if a == "conflicts" || a == "backlog" {
                        given.push(("only".to_owned(), a.to_owned()));
                        continue;
                    }
                    bail!("unexpected argument {a:?}\n\n{USAGE}");
                };
                let (name, value) = match name.split_once('=') {
                    Some((n, v)) => (n.to_owned(), v.to_owned()),
                    None => {
                        let v = it
                            .next()
                            .with_context(|| format!("--{name} needs a value"))?;
                        (name.to_owned(), v)
                    }
                };
                if !FLAGS.contains(&name.as_str()) {
                    bail!("unknown flag --{name}\n\n{USAGE}");
                }
                given.push((name, value));
            }
        }
    }
    let mut a = Args {
        rows: if quick { 10_000 } else { 200_000 },
        clients: 4,
        sync_commit: false,
        only: vec![1, 2, 3, 4, 5, 6],
        systems: vec![Kind::Native, Kind::Mm],
        tpcb_seconds: if quick { 5 } else { 25 },
        tpcb_rates: vec![100, 300],
        tpcb_clients: 2,
        accounts: if quick { 10_000 } else { 100_000 },
        heartbeat_ms: 100,
        sample_ms: 10,
        idle_seconds: if quick { 1 } else { 3 },
        agent_log: "info".to_owned(),
        conflict_clients: 2,
        conflict_txns: if quick { 1000 } else { 5000 },
        conflict_keys: 1000,
        hot_keys: 100,
        conflict_heartbeat_ms: 20,
        backlog_shapes: Shape::ALL.to_vec(),
        backlog: if quick {
            BacklogConfig {
                rows: 5_000,
                batch_rows: 20_000,
                one_txn_rows: 20_000,
                streamed_rows: 300_000,
            }
        } else {
            BacklogConfig {
                rows: 50_000,
                batch_rows: 200_000,
                one_txn_rows: 200_000,
                streamed_rows: 1_000_000,
            }
        },
        backlog_repeat: 1,
        quick,
    };
    for (name, v) in given {
        let num = || -> Result<u64> {
            v.trim()
                .parse()
                .with_context(|| format!("--{name}: {v:?} is not a non-negative integer"))
        };
        match name.as_str() {
            "rows" => a.rows = num()?.max(1),
            "clients" => a.clients = usize::try_from(num()?.max(1))?,
            "tpcb-seconds" => a.tpcb_seconds = num()?.max(1),
            "tpcb-rate" => {
                a.tpcb_rates = v
                    .split(',')
                    .filter(|s| !s.trim().is_empty())
                    .map(|s| {
                        s.trim()
                            .parse()
                            .with_context(|| format!("--tpcb-rate: {s:?} is not a rate"))
                    })
                    .collect::<Result<_>>()?;
                if a.tpcb_rates.is_empty() {
                    bail!("--tpcb-rate needs at least one rate");
                }
            }
            "tpcb-clients" => a.tpcb_clients = usize::try_from(num()?.max(1))?,
            "accounts" => a.accounts = num()?.max(1),
            "heartbeat-ms" => a.heartbeat_ms = num()?.max(1),
            "sample-ms" => a.sample_ms = num()?.max(1),
            "idle-seconds" => a.idle_seconds = num()?,
            "agent-log" => a.agent_log = v,
            "conflict-clients" => a.conflict_clients = usize::try_from(num()?.max(1))?,
            "conflict-txns" => a.conflict_txns = num()?.max(1),
            "conflict-keys" => a.conflict_keys = num()?.max(1),
            "hot-keys" => a.hot_keys = num()?.max(1),
            "conflict-heartbeat-ms" => a.conflict_heartbeat_ms = num()?.max(1),
            "backlog-rows" => a.backlog.rows = num()?.max(1),
            "backlog-batch-rows" => a.backlog.batch_rows = num()?.max(1),
            "backlog-one-rows" => a.backlog.one_txn_rows = num()?.max(1),
            "backlog-streamed-rows" => a.backlog.streamed_rows = num()?.max(1),
            "backlog-repeat" => a.backlog_repeat = usize::try_from(num()?.max(1))?,
            "backlog-shapes" => {
                a.backlog_shapes = v
                    .split(',')
                    .filter(|s| !s.trim().is_empty())
                    .map(|s| {
                        Shape::parse(s.trim()).with_context(|| {
                            format!("--backlog-shapes: {s:?} is not one of ins1, upd1, del1, ins1000, one, streamed")
                        })
                    })
                    .collect::<Result<_>>()?;
            }
            "sync-commit" => {
                a.sync_commit = match v.as_str() {
                    "on" => true,
                    "off" => false,
                    _ => bail!("--sync-commit: {v:?} is neither on nor off"),
                }
            }
            "systems" => {
                a.systems = v
                    .split(',')
                    .filter(|s| !s.trim().is_empty())
                    .map(|s| match s.trim() {
                        "native" => Ok(Kind::Native),
                        "mm" => Ok(Kind::Mm),
                        _ => bail!("--systems: {s:?} is neither native nor mm"),
                    })
                    .collect::<Result<_>>()?;
            }
            "only" => {
                a.only = v
                    .split(',')
                    .filter(|s| !s.trim().is_empty())
                    .map(|s| match workload_number(s.trim()) {
                        Some(n) => Ok(n),
                        None => bail!(
                            "--only: {s:?} is not a workload number 1-6, conflicts or backlog"
                        ),
                    })
                    .collect::<Result<_>>()?;
            }
            other => bail!("unknown flag --{other}"),
        }
    }
    Ok(Some(a))
}

/// One workload's numbers for each system that ran.
struct Row {
    name: String,
    native: Option<Measured>,
    mm: Option<Measured>,
}

impl Row {
    fn ratio(&self) -> Option<f64> {
        Some(self.mm?.rows_per_sec() / self.native?.rows_per_sec())
    }
}

fn print_measured(label: &str, m: &Measured) {
    println!(
        "  {label:<6} rows {:>8}  publisher done {:>7.2} s  subscriber has all {:>7.2} s  {:>9.0} rows/s \
         | cpu s: agent {:.2}, apply backends {:.2}, walsender {:.2}, reverse {:.2} | busy cores {:.2} | agent peak rss {:.0} MB",
        m.rows,
        m.load.as_secs_f64(),
        m.total.as_secs_f64(),
        m.rows_per_sec(),
        m.res.agent_cpu,
        m.res.apply_cpu,
        m.res.walsender_cpu,
        m.res.reverse_cpu,
        m.res.busy_cores,
        m.res.agent_peak_rss as f64 / 1e6
    );
}

/// CPU seconds as "apply+walsender (reverse)" (native) or
/// "agent+apply+walsender (reverse)" (mm), and the agent's peak RSS in MB,
/// as table cells. Reverse: the other direction's processes (`Resources`).
fn resource_cells(native: Option<&Resources>, mm: Option<&Resources>) -> [String; 3] {
    let dash = || "-".to_owned();
    [
        native.map_or_else(dash, |r| {
            format!(
                "{:.1}+{:.1} ({:.1})",
                r.apply_cpu, r.walsender_cpu, r.reverse_cpu
            )
        }),
        mm.map_or_else(dash, |r| {
            format!(
                "{:.1}+{:.1}+{:.1} ({:.1})",
                r.agent_cpu, r.apply_cpu, r.walsender_cpu, r.reverse_cpu
            )
        }),
        mm.map_or_else(dash, |r| format!("{:.0}", r.agent_peak_rss as f64 / 1e6)),
    ]
}

/// `resource_cells` for one system's run (by its label): CPU seconds and
/// the agent's peak RSS (a dash for native).
fn system_resource_cells(label: &str, r: &Resources) -> [String; 2] {
    let [ncpu, mcpu, rss] = if label == "mm" {
        resource_cells(None, Some(r))
    } else {
        resource_cells(Some(r), None)
    };
    [if label == "mm" { mcpu } else { ncpu }, rss]
}

/// Seconds and rows/s as table cells, dashes for a system that did not run.
fn cells(m: Option<Measured>) -> (String, String) {
    match m {
        Some(m) => (
            format!("{:.2}", m.total.as_secs_f64()),
            format!("{:.0}", m.rows_per_sec()),
        ),
        None => ("-".to_owned(), "-".to_owned()),
    }
}

struct Lag {
    p50: f64,
    p95: f64,
    p99: f64,
    max: f64,
    n: usize,
}

fn lag(v: &[f64]) -> Lag {
    Lag {
        p50: percentile(v, 50.0),
        p95: percentile(v, 95.0),
        p99: percentile(v, 99.0),
        max: percentile(v, 100.0),
        n: v.len(),
    }
}

fn print_tpcb(label: &str, t: &TpcbResult) {
    let s = lag(&t.load.staleness);
    let d = lag(&t.load.delivery);
    let idle = lag(&t.idle.staleness);
    println!(
        "  {label:<6} pgbench {} + {} txns ({:.0} + {:.0} tps); drain after load {:.2} s",
        t.txns[0],
        t.txns[1],
        t.tps[0],
        t.tps[1],
        t.drain.as_secs_f64()
    );
    println!(
        "         staleness ms p50 {:.0} p95 {:.0} p99 {:.0} max {:.0} ({} samples; idle p50 {:.0})",
        s.p50, s.p95, s.p99, s.max, s.n, idle.p50
    );
    println!(
        "         delivery  ms p50 {:.0} p95 {:.0} p99 {:.0} max {:.0} ({} heartbeats)",
        d.p50, d.p95, d.p99, d.max, d.n
    );
    println!(
        "         cpu s A->B: agent {:.2}, apply backends {:.2}, walsender {:.2}, reverse {:.2} | agent peak rss {:.0} MB",
        t.res.agent_cpu,
        t.res.apply_cpu,
        t.res.walsender_cpu,
        t.res.reverse_cpu,
        t.res.agent_peak_rss as f64 / 1e6
    );
}

fn print_conflicts(label: &str, r: &ConflictResult) {
    let d = lag(&r.lag.delivery);
    let st = lag(&r.lag.staleness);
    println!(
        "  {label:<6} {} update txns on {} rows: writers done {:.2} s ({:.0} txns/s), both nodes have all {:.2} s ({:.0} txns/s)",
        r.txns,
        r.rows,
        r.writers.as_secs_f64(),
        r.writer_tps(),
        r.converged.as_secs_f64(),
        r.converged_tps()
    );
    println!(
        "         delivery  ms p50 {:.0} p95 {:.0} max {:.0} ({} heartbeats); staleness ms p50 {:.0} p95 {:.0} max {:.0}",
        d.p50, d.p95, d.max, d.n, st.p50, st.p95, st.max
    );
    let c = &r.conflicts;
    println!(
        "         conflicts {} ({:.1}% of txns) {:?}; routine {}; applied txns {}; rolled back {}; in place {}",
        c.total(),
        100.0 * r.conflict_rate(),
        c.by_type,
        na(c.routine),
        na(c.applied_txns),
        na(c.rollbacks),
        na(c.in_place)
    );
    println!(
        "         end state: {}; sum(n) A {} B {} of {} updates",
        identical(r),
        r.sums[0],
        r.sums[1],
        r.txns
    );
    for e in &c.errors {
        println!("         ERROR {e}");
    }
}

fn identical(r: &ConflictResult) -> String {
    if r.differing_rows == 0 {
        "identical".to_owned()
    } else {
        format!("DIVERGED, {} of {} rows differ", r.differing_rows, r.rows)
    }
}

fn ratio_cell(mm: f64, native: f64) -> String {
    if mm.is_finite() && native.is_finite() && native > 0.0 {
        format!("{:.2}", mm / native)
    } else {
        "-".to_owned()
    }
}

fn conflicts_markdown(args: &Args, runs: &[(String, ConflictResult)]) -> String {
    let mut s = format!(
        "\nConflicts: single-row UPDATE txns on both nodes at once, {} clients/node x {} txns each; \
         disjoint = node A keys 1..{k}, node B keys {}..{}; hot = both nodes on keys 1..{}. \
         Lag = delivery of a heartbeat written every {} ms while the writers run, both directions pooled:\n\n",
        args.conflict_clients,
        args.conflict_txns,
        args.conflict_keys + 1,
        2 * args.conflict_keys,
        args.hot_keys,
        args.conflict_heartbeat_ms,
        k = args.conflict_keys,
    );
    s.push_str("| keys | system | writers txns/s | converged s | txns/s to converged | lag p50 / p95 / max ms | conflicts | conflict rate | routine | sum(n) A / B | end state | cpu s A->B: native apply+wal (reverse) / mm agent+apply+wal (reverse) |\n");
    s.push_str("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|\n");
    for keys in [KeySet::Disjoint, KeySet::Hot] {
        let of = |label: &str| {
            runs.iter()
                .find(|(l, r)| l == label && r.keys == keys)
                .map(|(_, r)| r)
        };
        for (label, r) in runs.iter().filter(|(_, r)| r.keys == keys) {
            let d = lag(&r.lag.delivery);
            let [cpu, _] = system_resource_cells(label, &r.res);
            s.push_str(&format!(
                "| {} | {label} | {:.0} | {:.2} | {:.0} | {:.0} / {:.0} / {:.0} | {} | {:.1}% | {} | {} / {} | {} | {cpu} |\n",
                keys.label(),
                r.writer_tps(),
                r.converged.as_secs_f64(),
                r.converged_tps(),
                d.p50,
                d.p95,
                d.max,
                r.conflicts.total(),
                100.0 * r.conflict_rate(),
                r.conflicts.routine.map_or("-".to_owned(), |n| n.to_string()),
                r.sums[0],
                r.sums[1],
                identical(r)
            ));
        }
        if let (Some(n), Some(m)) = (of("native"), of("mm")) {
            let (dn, dm) = (lag(&n.lag.delivery), lag(&m.lag.delivery));
            s.push_str(&format!(
                "| {} | **mm/native** | {} | | {} | {} / {} / {} | | | | | | |\n",
                keys.label(),
                ratio_cell(m.writer_tps(), n.writer_tps()),
                ratio_cell(m.converged_tps(), n.converged_tps()),
                ratio_cell(dm.p50, dn.p50),
                ratio_cell(dm.p95, dn.p95),
                ratio_cell(dm.max, dn.max)
            ));
        }
    }
    s.push_str(
        "\n(converged = from the start until each node holds every write of the other (a fence row each way); \
         conflict rate = conflicts / update txns of both nodes; mm counts from `mmctl status --json`, \
         native from pg_stat_subscription_stats, which counts every change to a row last written by \
         another origin, concurrent or not, and always applies the remote change (no resolution); \
         sum(n) = updates whose increment survived on each node, of the txns count (a concurrent update \
         of the same row on the other node overwrites one); \
         end state compares every row of the table on both nodes. Throughput ratios > 1 and lag ratios < 1 favour mm.)\n",
    );
    s
}

fn markdown(
    args: &Args,
    rows: &[Row],
    tpcb: &[(String, u64, TpcbResult)],
    conflicts: &[(String, ConflictResult)],
) -> String {
    let mut s = String::new();
    if !rows.is_empty() {
        s.push_str(
            "| workload | rows | native s | native rows/s | mm s | mm rows/s | mm/native \
             | cpu s native apply+wal (reverse) | cpu s mm agent+apply+wal (reverse) | mm agent peak RSS MB |\n",
        );
        s.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
        for r in rows {
            let (ns, nr) = cells(r.native);
            let (ms, mr) = cells(r.mm);
            let n_rows = r.native.or(r.mm).map_or(0, |m| m.rows);
            let ratio = r.ratio().map_or("-".to_owned(), |x| format!("{x:.2}"));
            let [ncpu, mcpu, rss] = resource_cells(
                r.native.as_ref().map(|m| &m.res),
                r.mm.as_ref().map(|m| &m.res),
            );
            s.push_str(&format!(
                "| {} | {n_rows} | {ns} | {nr} | {ms} | {mr} | {ratio} | {ncpu} | {mcpu} | {rss} |\n",
                r.name
            ));
        }
        s.push_str(
            "\n(s = from the start of the workload on node A until node B has every row; \
             publisher-side times are in the log above)\n",
        );
    }
    if !tpcb.is_empty() {
        s.push_str(&format!(
            "\nBidirectional TPC-B-like, {} s, pgbench -c {} -R <rate> on each node, disjoint keys; \
             lag of a heartbeat written every {} ms, sampled every {} ms (jittered ±50%), both directions pooled:\n\n",
            args.tpcb_seconds,
            args.tpcb_clients,
            args.heartbeat_ms,
            args.sample_ms
        ));
        s.push_str("| system | rate/node | tps A+B | staleness p50 / p95 / p99 / max ms | delivery p50 / p95 / p99 ms | idle staleness p50 ms | drain s | cpu s A->B: native apply+wal (reverse) / mm agent+apply+wal (reverse) | mm agent peak RSS MB |\n");
        s.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
        for (label, rate, t) in tpcb {
            let st = lag(&t.load.staleness);
            let d = lag(&t.load.delivery);
            let idle = lag(&t.idle.staleness);
            let [cpu, rss] = system_resource_cells(label, &t.res);
            s.push_str(&format!(
                "| {label} | {rate} | {:.0} | {:.0} / {:.0} / {:.0} / {:.0} | {:.0} / {:.0} / {:.0} | {:.0} | {:.2} | {cpu} | {rss} |\n",
                t.tps[0] + t.tps[1],
                st.p50,
                st.p95,
                st.p99,
                st.max,
                d.p50,
                d.p95,
                d.p99,
                idle.p50,
                t.drain.as_secs_f64()
            ));
        }
        s.push_str(
            "\n(staleness = subscriber clock minus the newest heartbeat it holds, at each sample: \
             includes 0..1 heartbeat period; delivery = age of each heartbeat when first seen: \
             includes 0..1 sampling period)\n",
        );
    }
    if !conflicts.is_empty() {
        s.push_str(&conflicts_markdown(args, conflicts));
    }
    s
}

fn print_backlog(label: &str, b: &Backlog) {
    println!(
        "  {label:>6}: {} rows in {} txns committed in {:.2} s; caught up in {:.2} s = {:.0} rows/s \
         | cpu s: agent {:.2}, apply backends {:.2}, walsender {:.2}, reverse {:.2} | busy cores {:.2} | agent peak rss {:.0} MB",
        b.rows,
        b.txns,
        b.load.as_secs_f64(),
        b.catch_up.as_secs_f64(),
        b.rows_per_sec(),
        b.res.agent_cpu,
        b.res.apply_cpu,
        b.res.walsender_cpu,
        b.res.reverse_cpu,
        b.res.busy_cores,
        b.res.agent_peak_rss as f64 / 1e6
    );
}

/// Native and mm side by side per shape; mm/native is the ratio of catch-up
/// rates (>= 1: mm applies at least as fast). With several runs of a shape
/// (`--backlog-repeat`): each system's median run, and the median and
/// range of the ratios of the runs paired in order.
fn backlog_markdown(runs: &[(String, Backlog)]) -> String {
    let mut s = String::from(
        "Backlog catch-up (stream stopped, backlog committed on A, stream started; time until B has everything):\n\n\
         | shape | rows | txns | runs | native s | native rows/s | mm s | mm rows/s | mm/native | cpu s native apply+wal (reverse) | cpu s mm agent+apply+wal (reverse) | busy cores native / mm | mm agent peak RSS MB |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for shape in Shape::ALL {
        let all = |l: &str| -> Vec<Backlog> {
            runs.iter()
                .filter(|(k, b)| k == l && b.shape == shape)
                .map(|(_, b)| *b)
                .collect()
        };
        let (ns, ms) = (all("native"), all("mm"));
        let (n, m) = (median_run(&ns), median_run(&ms));
        let Some(any) = n.or(m) else { continue };
        let cell = |b: Option<Backlog>| {
            b.map_or(("-".to_owned(), "-".to_owned()), |b| {
                (
                    format!("{:.2}", b.catch_up.as_secs_f64()),
                    format!("{:.0}", b.rows_per_sec()),
                )
            })
        };
        let ((nsec, nr), (msec, mr)) = (cell(n), cell(m));
        let mut ratios: Vec<f64> = ns
            .iter()
            .zip(&ms)
            .map(|(n, m)| m.rows_per_sec() / n.rows_per_sec())
            .collect();
        ratios.sort_by(f64::total_cmp);
        let ratio = match ratios.as_slice() {
            [] => "-".to_owned(),
            [r] => format!("{r:.2}"),
            [lo, .., hi] => format!("{:.2} ({lo:.2}-{hi:.2})", ratios[ratios.len() / 2]),
        };
        let [ncpu, mcpu, rss] =
            resource_cells(n.as_ref().map(|b| &b.res), m.as_ref().map(|b| &b.res));
        let busy =
            |b: Option<Backlog>| b.map_or("-".to_owned(), |b| format!("{:.1}", b.res.busy_cores));
        let busy = format!("{} / {}", busy(n), busy(m));
        s.push_str(&format!(
            "| {} | {} | {} | {} | {nsec} | {nr} | {msec} | {mr} | {ratio} | {ncpu} | {mcpu} | {busy} | {rss} |\n",
            shape.label(),
            any.rows,
            any.txns,
            ns.len().max(ms.len()),
        ));
    }
    s
}

/// The run with the median catch-up rate (the upper one of an even count).
fn median_run(runs: &[Backlog]) -> Option<Backlog> {
    let mut v = runs.to_vec();
    v.sort_by(|a, b| a.rows_per_sec().total_cmp(&b.rows_per_sec()));
    v.get(v.len() / 2).copied()
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| {
            let f: Vec<&str> = l.split_whitespace().take(3).collect();
            (f.len() == 3).then(|| f.join(" "))
        })
        .unwrap_or_else(|| "?".to_owned())
}

async fn run(args: Args) -> Result<()> {
    let bin = mm_tests::pg_bin_dir()?;
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "mm-bench: {}; {} cores, load {}; {} build; agent {}; agent MM_LOG={}",
        mm_tests::postgres_version(&bin)?,
        cores,
        loadavg(),
        if cfg!(debug_assertions) {
            "DEBUG"
        } else {
            "release"
        },
        mm_tests::agent::agent_bin()?.display(),
        args.agent_log
    );
    println!(
        "rows {} clients {} synchronous_commit {} | tpc-b {} s, rate {:?}/s/node, {} clients/node, {} accounts/node \
         | conflicts {} clients/node x {} txns, {} keys/node, {} hot keys{}",
        args.rows,
        args.clients,
        if args.sync_commit { "on" } else { "off" },
        args.tpcb_seconds,
        args.tpcb_rates,
        args.tpcb_clients,
        args.accounts,
        args.conflict_clients,
        args.conflict_txns,
        args.conflict_keys,
        args.hot_keys,
        if args.quick { " | QUICK" } else { "" }
    );
    let workdir = tempfile::tempdir()?;

    // Both systems stay up for the whole run so each workload runs on one and
    // then the other minutes apart: the ratio sees the same machine weather.
    let t = std::time::Instant::now();
    let mut systems = Vec::new();
    if args.systems.contains(&Kind::Native) {
        systems.push(System::native(["na", "nb"]).await.context("native setup")?);
    }
    if args.systems.contains(&Kind::Mm) {
        systems.push(
            System::mm(["b1", "b2"], &args.agent_log)
                .await
                .context("mm setup")?,
        );
    }
    println!("setup {:.1} s", t.elapsed().as_secs_f64());

    let driver = bench::Driver {
        clients: args.clients,
        sync_commit: args.sync_commit,
    };
    let mut rows: Vec<Row> = Vec::new();
    let mut tpcb: Vec<(String, u64, TpcbResult)> = Vec::new();
    let mut conflicts: Vec<(String, ConflictResult)> = Vec::new();
    let mut backlogs: Vec<(String, Backlog)> = Vec::new();
    for w in args.only.clone() {
        if w == 6 {
            for &shape in &args.backlog_shapes {
                println!("6. backlog catch-up: {}", shape.label());
                for turn in 0..args.backlog_repeat {
                    // Taking turns to go first: neither system always
                    // meets the machine warmed up by the other.
                    let order: Vec<&System> = if turn % 2 == 0 {
                        systems.iter().collect()
                    } else {
                        systems.iter().rev().collect()
                    };
                    for sys in order {
                        let r = backlog::run(sys, shape, &args.backlog).await?;
                        print_backlog(sys.label(), &r);
                        backlogs.push((sys.label().to_owned(), r));
                    }
                }
            }
            continue;
        }
        if w == 5 {
            let cfg = ConflictConfig {
                clients: args.conflict_clients,
                txns: args.conflict_txns,
                disjoint_keys: args.conflict_keys,
                hot_keys: args.hot_keys,
                sync_commit: args.sync_commit,
                heartbeat: Duration::from_millis(args.conflict_heartbeat_ms),
                sample: Duration::from_millis(args.sample_ms),
            };
            for keys in [KeySet::Disjoint, KeySet::Hot] {
                println!(
                    "5. conflicts: single-row UPDATE txns on both nodes, {} ({} clients/node x {} txns)",
                    keys.label(),
                    cfg.clients,
                    cfg.txns
                );
                for sys in &systems {
                    let r = bench::conflicting_updates(sys, keys, &cfg).await?;
                    print_conflicts(sys.label(), &r);
                    conflicts.push((sys.label().to_owned(), r));
                }
            }
            continue;
        }
        if w == 4 {
            for &rate in &args.tpcb_rates {
                println!("4. TPC-B-like on both nodes at {rate} tps/node, lag");
                let cfg = TpcbConfig {
                    accounts: args.accounts,
                    seconds: args.tpcb_seconds,
                    rate,
                    clients: args.tpcb_clients,
                    heartbeat: Duration::from_millis(args.heartbeat_ms),
                    sample: Duration::from_millis(args.sample_ms),
                    idle: Duration::from_secs(args.idle_seconds),
                };
                for sys in &systems {
                    let r = bench::tpcb_both_ways(sys, &cfg, workdir.path()).await?;
                    print_tpcb(sys.label(), &r);
                    tpcb.push((sys.label().to_owned(), rate, r));
                }
            }
            continue;
        }
        let name = match w {
            1 => format!("1. single-row INSERT txns ({} clients)", args.clients),
            2 => "2. one INSERT txn".to_owned(),
            3 => format!("3. single-row UPDATE txns ({} clients)", args.clients),
            other => bail!("no workload {other}"),
        };
        println!("{name}");
        let mut row = Row {
            name,
            native: None,
            mm: None,
        };
        for sys in &systems {
            let m = match w {
                1 => bench::single_row_inserts(sys, args.rows, driver).await?,
                2 => bench::one_big_insert(sys, args.rows).await?,
                _ => bench::single_row_updates(sys, args.rows, driver).await?,
            };
            print_measured(sys.label(), &m);
            match sys.kind {
                Kind::Native => row.native = Some(m),
                Kind::Mm => row.mm = Some(m),
            }
        }
        if let Some(r) = row.ratio() {
            println!("  mm/native {r:.2}");
        }
        rows.push(row);
    }
    println!("\n{}", markdown(&args, &rows, &tpcb, &conflicts));
    if !backlogs.is_empty() {
        println!("{}", backlog_markdown(&backlogs));
    }
    println!("load at end {}", loadavg());
    // Agents before servers (System's field order), mm before native.
    while let Some(sys) = systems.pop() {
        drop(sys);
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(Some(a)) => a,
        Ok(None) => return ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mm-bench: {e:#}");
            return ExitCode::from(2);
        }
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("mm-bench: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mm-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// A counter only one system has: "n/a" for the other.
fn na(n: Option<u64>) -> String {
    n.map_or("n/a".to_owned(), |n| n.to_string())
}
