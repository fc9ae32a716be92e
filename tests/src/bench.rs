//! The pieces of `mm-bench`: mm against PostgreSQL's native logical
//! replication, on the same machine, the same PostgreSQL build and the same
//! workload driver, so that only the replication path differs.
//!
//! Both systems are a pair of harness nodes `a` (index 0) and `b` (index 1)
//! replicating the same tables both ways:
//! - native: a publication on each node and a subscription on each node to the
//!   other, `origin = none` (what PostgreSQL >= 16 offers for bidirectional
//!   replication without loops), `copy_data = false`, everything else default;
//! - mm: one agent per node, formed with mmctl.
//!
//! Completion is detected the same way for both: after the workload, a fence
//! row is committed on the publisher; both appliers apply one origin's
//! transactions in commit order, so the fence appearing on the subscriber
//! means everything before it is there too (then verified with a count/sum).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU8, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use tokio::task::JoinSet;
use tokio_postgres::Client;

use crate::agent::{AgentProcess, Secrets, mmctl};
use crate::{PgNode, pg_bin_dir};

/// Every table any workload uses; created empty on both nodes before
/// replication starts (mm requires the tables on every node; the native
/// subscriptions are created with `copy_data = false`).
pub const SCHEMA: &str = "
CREATE TABLE bench_fence (id bigint PRIMARY KEY, src int NOT NULL);
CREATE TABLE t_insert (id bigint PRIMARY KEY, n bigint NOT NULL, v text NOT NULL);
CREATE TABLE t_bulk (id bigint PRIMARY KEY, n bigint NOT NULL, v text NOT NULL);
CREATE TABLE t_update (id bigint PRIMARY KEY, n bigint NOT NULL, v text NOT NULL);
CREATE TABLE bench_branches (bid int PRIMARY KEY, bbalance bigint NOT NULL, filler char(88));
CREATE TABLE bench_tellers (tid int PRIMARY KEY, bid int NOT NULL, tbalance bigint NOT NULL, filler char(84));
CREATE TABLE bench_accounts (aid int PRIMARY KEY, bid int NOT NULL, abalance bigint NOT NULL, filler char(84));
-- Keyed by the writing node: both nodes insert history rows concurrently.
CREATE TABLE bench_history (node int NOT NULL, hid bigserial, tid int, bid int, aid int, delta int,
                            mtime timestamp, filler char(22), PRIMARY KEY (node, hid));
CREATE TABLE bench_heartbeat (node int PRIMARY KEY, seq bigint NOT NULL, sent timestamptz NOT NULL);
";

const TABLES: &str = "bench_fence, t_insert, t_bulk, t_update, bench_branches, bench_tellers, \
                      bench_accounts, bench_history, bench_heartbeat";

/// How long a system may take to deliver a workload before the run fails.
const CATCH_UP_TIMEOUT: Duration = Duration::from_secs(1800);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Native,
    Mm,
}

impl Kind {
    pub fn label(self) -> &'static str {
        match self {
            Kind::Native => "native",
            Kind::Mm => "mm",
        }
    }
}

/// Two replicating nodes. Field order is drop order: agents stop before the
/// servers they stream from.
pub struct System {
    pub kind: Kind,
    agents: Vec<AgentProcess>,
    secrets: Option<Secrets>,
    pub nodes: Vec<PgNode>,
    fence_seq: AtomicI64,
    _dir: Option<tempfile::TempDir>,
}

impl System {
    /// Two nodes replicating every bench table both ways with PostgreSQL's
    /// own publications and subscriptions.
    pub async fn native(names: [&str; 2]) -> Result<System> {
        let nodes = start_nodes(&names).await?;
        for n in &nodes {
            n.execute(&format!("CREATE PUBLICATION p FOR TABLE {TABLES}"))
                .await?;
        }
        for (i, j) in [(1usize, 0usize), (0, 1)] {
            // The apply worker connects over TCP as the server user; the
            // harness trusts loopback connections.
            let sql = format!(
                "CREATE SUBSCRIPTION s_from_{from} CONNECTION '{dsn}' PUBLICATION p \
                 WITH (copy_data = false, origin = none)",
                from = names[j].replace('-', "_"),
                dsn = nodes[j].dsn(),
            );
            nodes[i].execute(&sql).await?;
        }
        let sys = System {
            kind: Kind::Native,
            agents: Vec::new(),
            secrets: None,
            nodes,
            fence_seq: AtomicI64::new(0),
            _dir: None,
        };
        sys.fence_both_ways(Duration::from_secs(60))
            .await
            .context("native subscriptions never delivered a first row")?;
        Ok(sys)
    }

    /// Two nodes with an agent each, formed with `mmctl init` / `add-node`.
    /// `agent_log` is the agents' MM_LOG filter: the harness default logs
    /// every transaction at debug level, which is not what a benchmark wants.
    pub async fn mm(names: [&str; 2], agent_log: &str) -> Result<System> {
        let nodes = start_nodes(&names).await?;
        let dir = tempfile::tempdir()?;
        let token_file = dir.path().join("token");
        std::fs::write(&token_file, random_token()?)?;
        let secrets = Secrets { token_file };
        let mut agents = Vec::new();
        for (n, node) in names.iter().zip(&nodes) {
            agents.push(AgentProcess::spawn_with(
                n,
                node,
                &secrets,
                &[("MM_LOG", agent_log)],
                "",
            )?);
        }
        for a in &mut agents {
            a.wait_ready(Duration::from_secs(30)).await?;
        }
        let sys = System {
            kind: Kind::Mm,
            agents,
            secrets: Some(secrets),
            nodes,
            fence_seq: AtomicI64::new(0),
            _dir: Some(dir),
        };
        sys.mmctl(&["init"]).await?;
        let url = sys.agents[1].url();
        sys.mmctl(&["add-node", "--name", names[1], "--url", &url])
            .await?;
        sys.fence_both_ways(Duration::from_secs(60))
            .await
            .context("mm streams never delivered a first row")?;
        Ok(sys)
    }

    pub fn label(&self) -> &'static str {
        self.kind.label()
    }

    pub fn a(&self) -> &PgNode {
        &self.nodes[0]
    }

    pub fn b(&self) -> &PgNode {
        &self.nodes[1]
    }

    pub fn agents(&self) -> &[AgentProcess] {
        &self.agents
    }

    async fn mmctl(&self, args: &[&str]) -> Result<String> {
        let (Some(secrets), Some(agent)) = (&self.secrets, self.agents.first()) else {
            bail!("mmctl needs an mm system");
        };
        let out = mmctl(&agent.url(), &secrets.token_file, args).await?;
        if !out.success() {
            let mut logs = String::new();
            for a in &self.agents {
                logs.push_str(&format!("\n--- agent {} ---\n{}", a.name, a.log_tail(30)));
            }
            bail!(
                "mmctl {}: {}{}{logs}",
                args.join(" "),
                out.stderr,
                out.stdout
            );
        }
        Ok(out.stdout)
    }

    /// Commits a fence row on node `from` and returns its id.
    async fn write_fence(&self, from: usize) -> Result<i64> {
        let id = self.fence_seq.fetch_add(1, Ordering::Relaxed) + 1;
        self.nodes[from]
            .execute(&format!(
                "INSERT INTO bench_fence (id, src) VALUES ({id}, {from})"
            ))
            .await?;
        Ok(id)
    }

    /// Polls node `on` (every 5 ms, a primary-key lookup) until fence `id`
    /// is there.
    async fn wait_fence(&self, on: usize, id: i64, timeout: Duration) -> Result<()> {
        let client = self.nodes[on].connect().await?;
        let stmt = client
            .prepare("SELECT 1 FROM bench_fence WHERE id = $1")
            .await?;
        let deadline = Instant::now() + timeout;
        loop {
            if client.query_opt(&stmt, &[&id]).await?.is_some() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "{}: fence {id} did not reach node {} within {timeout:?}{}",
                    self.label(),
                    self.nodes[on].name(),
                    self.diagnostics()
                );
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// A fence from each node seen on the other: both directions flow and
    /// everything committed before is delivered.
    pub async fn fence_both_ways(&self, timeout: Duration) -> Result<()> {
        let f0 = self.write_fence(0).await?;
        let f1 = self.write_fence(1).await?;
        self.wait_fence(1, f0, timeout).await?;
        self.wait_fence(0, f1, timeout).await
    }

    /// Everything written so far is everywhere: fences both ways, and for mm
    /// also its own barrier, `mmctl wait-sync`.
    pub async fn settle(&self) -> Result<()> {
        self.fence_both_ways(CATCH_UP_TIMEOUT).await?;
        if self.kind == Kind::Mm {
            self.mmctl(&["wait-sync", "--timeout", "600"]).await?;
        }
        Ok(())
    }

    /// Fresh checkpoints on both nodes, so no run pays for the previous
    /// run's dirty buffers.
    pub async fn checkpoint(&self) -> Result<()> {
        for n in &self.nodes {
            n.execute("CHECKPOINT").await?;
        }
        Ok(())
    }

    /// After the workload ended on node 0: fence, wait for it on node 1,
    /// then check that `check_sql` there returns `want`. Returns the time
    /// from `start` at which node 1 had everything.
    async fn delivered(&self, start: Instant, check_sql: &str, want: &str) -> Result<Duration> {
        let fence = self.write_fence(0).await?;
        self.wait_fence(1, fence, CATCH_UP_TIMEOUT).await?;
        let mut done = start.elapsed();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let got = self.b().query_one_string(check_sql).await?;
            if got.as_deref() == Some(want) {
                return Ok(done);
            }
            // Cannot happen with in-order apply; if it does, say so and
            // time until the data really is there.
            eprintln!(
                "warning: {}: fence arrived but {check_sql} = {got:?}, want {want}",
                self.label()
            );
            if Instant::now() > deadline {
                bail!(
                    "{}: {check_sql} on {} is {got:?}, want {want}",
                    self.label(),
                    self.b().name()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            done = start.elapsed();
        }
    }

    fn diagnostics(&self) -> String {
        let mut s = String::new();
        for a in &self.agents {
            s.push_str(&format!("\n--- agent {} ---\n{}", a.name, a.log_tail(30)));
        }
        for n in &self.nodes {
            s.push_str(&format!(
                "\n--- server {} ---\n{}",
                n.name(),
                n.log_tail(15)
            ));
        }
        s
    }
}

async fn start_nodes(names: &[&str; 2]) -> Result<Vec<PgNode>> {
    let mut nodes = Vec::new();
    for n in names {
        let node = PgNode::start(n)?;
        node.execute(SCHEMA)
            .await
            .with_context(|| format!("schema on {n}"))?;
        nodes.push(node);
    }
    Ok(nodes)
}

fn random_token() -> Result<String> {
    let mut buf = [0u8; 24];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut buf)?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// One throughput measurement.
#[derive(Debug, Clone, Copy)]
pub struct Measured {
    pub rows: u64,
    /// Until the workload finished on the publisher.
    pub load: Duration,
    /// Until the subscriber had every row.
    pub total: Duration,
}

impl Measured {
    pub fn rows_per_sec(&self) -> f64 {
        self.rows as f64 / self.total.as_secs_f64().max(1e-9)
    }
}

/// How the single-row workloads are driven on the publisher.
#[derive(Debug, Clone, Copy)]
pub struct Driver {
    /// Concurrent connections, ids spread round-robin over them.
    pub clients: usize,
    /// `synchronous_commit` of the driving sessions.
    pub sync_commit: bool,
}

/// `clients` connections to `node`, each with `sql` prepared, opened before
/// any timing starts.
async fn open_clients(
    node: &PgNode,
    clients: usize,
    sync_commit: bool,
    sql: &str,
) -> Result<Vec<(Client, tokio_postgres::Statement)>> {
    let mut out = Vec::new();
    for _ in 0..clients.max(1) {
        let c = node.connect().await?;
        if !sync_commit {
            // A few connections waiting for their own WAL flush each would
            // make the publisher's disk the bottleneck, not replication.
            c.batch_execute("SET synchronous_commit = off").await?;
        }
        let stmt = c.prepare(sql).await?;
        out.push((c, stmt));
    }
    Ok(out)
}

/// Runs the prepared one-parameter statement once per id in 1..=total, each
/// in its own (autocommit) transaction, spread round-robin over the clients,
/// all concurrently: the same driver for both systems.
async fn drive(clients: Vec<(Client, tokio_postgres::Statement)>, total: u64) -> Result<()> {
    let n = clients.len() as i64;
    let total = i64::try_from(total).context("row count too large")?;
    let mut set = JoinSet::new();
    for (k, (client, stmt)) in clients.into_iter().enumerate() {
        set.spawn(async move {
            let mut id = k as i64 + 1;
            while id <= total {
                client.execute(&stmt, &[&id]).await?;
                id += n;
            }
            Ok::<_, anyhow::Error>(())
        });
    }
    while let Some(r) = set.join_next().await {
        r.context("driver task")??;
    }
    Ok(())
}

/// Workload 1: `rows` single-row INSERT transactions from `clients`
/// connections on node a.
pub async fn single_row_inserts(sys: &System, rows: u64, driver: Driver) -> Result<Measured> {
    let conns = open_clients(
        sys.a(),
        driver.clients,
        driver.sync_commit,
        "INSERT INTO t_insert (id, n, v) VALUES ($1::bigint, $1::bigint, md5($1::bigint::text))",
    )
    .await?;
    sys.checkpoint().await?;
    let start = Instant::now();
    drive(conns, rows).await?;
    let load = start.elapsed();
    let total = sys
        .delivered(start, "SELECT count(*) FROM t_insert", &rows.to_string())
        .await?;
    Ok(Measured { rows, load, total })
}

/// Workload 2: one transaction inserting `rows` rows on node a.
pub async fn one_big_insert(sys: &System, rows: u64) -> Result<Measured> {
    let client = sys.a().connect().await?;
    sys.checkpoint().await?;
    let start = Instant::now();
    client
        .batch_execute(&format!(
            "INSERT INTO t_bulk (id, n, v) SELECT g, g, md5(g::text) FROM generate_series(1, {rows}) g"
        ))
        .await?;
    let load = start.elapsed();
    let total = sys
        .delivered(start, "SELECT count(*) FROM t_bulk", &rows.to_string())
        .await?;
    Ok(Measured { rows, load, total })
}

/// Workload 3: `rows` single-row UPDATE transactions (each row of a
/// preloaded `rows`-row table once) from `clients` connections on node a.
/// The preload goes through replication and is settled before timing.
pub async fn single_row_updates(sys: &System, rows: u64, driver: Driver) -> Result<Measured> {
    sys.a()
        .execute(&format!(
            "INSERT INTO t_update (id, n, v) SELECT g, 0, md5(g::text) FROM generate_series(1, {rows}) g"
        ))
        .await?;
    sys.settle().await?;
    let preloaded = sys
        .b()
        .query_one_string("SELECT count(*) FROM t_update")
        .await?;
    ensure!(
        preloaded.as_deref() == Some(rows.to_string().as_str()),
        "{}: preload reached {} with {preloaded:?} rows, want {rows}",
        sys.label(),
        sys.b().name()
    );
    let conns = open_clients(
        sys.a(),
        driver.clients,
        driver.sync_commit,
        "UPDATE t_update SET n = n + 1 WHERE id = $1::bigint",
    )
    .await?;
    sys.checkpoint().await?;
    let start = Instant::now();
    drive(conns, rows).await?;
    let load = start.elapsed();
    let total = sys
        .delivered(
            start,
            "SELECT sum(n)::bigint FROM t_update",
            &rows.to_string(),
        )
        .await?;
    Ok(Measured { rows, load, total })
}

/// Settings of the bidirectional TPC-B-like run.
#[derive(Debug, Clone)]
pub struct TpcbConfig {
    /// Accounts per node (pgbench scale 1 = 100000).
    pub accounts: u64,
    pub seconds: u64,
    /// Target transactions per second per node (pgbench -R); 0 = unthrottled.
    pub rate: u64,
    pub clients: usize,
    pub heartbeat: Duration,
    pub sample: Duration,
    /// Heartbeats sampled with no load first: the floor of the method.
    pub idle: Duration,
}

/// Lag samples in milliseconds, both directions pooled.
#[derive(Debug, Default, Clone)]
pub struct LagSamples {
    /// At every sample: subscriber clock minus the send time of the newest
    /// heartbeat it has. Includes up to one heartbeat period by design.
    pub staleness: Vec<f64>,
    /// For each heartbeat seen for the first time: its age then. Includes up
    /// to one sampling period.
    pub delivery: Vec<f64>,
}

#[derive(Debug, Clone)]
pub struct TpcbResult {
    pub idle: LagSamples,
    pub load: LagSamples,
    /// pgbench's processed transactions and tps per node.
    pub txns: [u64; 2],
    pub tps: [f64; 2],
    /// From the end of pgbench until both nodes had each other's writes.
    pub drain: Duration,
}

const PGBENCH_SCRIPT: &str = "\
\\set aid random(:aoff + 1, :aoff + :naccounts)
\\set tid random(:toff + 1, :toff + 10)
\\set delta random(-5000, 5000)
BEGIN;
UPDATE bench_accounts SET abalance = abalance + :delta WHERE aid = :aid;
SELECT abalance FROM bench_accounts WHERE aid = :aid;
UPDATE bench_tellers SET tbalance = tbalance + :delta WHERE tid = :tid;
UPDATE bench_branches SET bbalance = bbalance + :delta WHERE bid = :bid;
INSERT INTO bench_history (node, tid, bid, aid, delta, mtime) VALUES (:node, :tid, :bid, :aid, :delta, CURRENT_TIMESTAMP);
END;
";

const PHASE_WARMUP: u8 = 0;
const PHASE_IDLE: u8 = 1;
const PHASE_LOAD: u8 = 2;
const PHASE_STOP: u8 = 3;

/// Workload 4: TPC-B-like transactions on both nodes at once, node i
/// touching only its own branch, tellers and accounts, while heartbeats
/// measure the replication lag each way.
pub async fn tpcb_both_ways(sys: &System, cfg: &TpcbConfig, workdir: &Path) -> Result<TpcbResult> {
    let n = cfg.accounts;
    // Node 0 owns branch 1, tellers 1-10, accounts 1..n; node 1 the next ones.
    // Loaded on node a and replicated, so both sides start identical; a
    // second run (another rate) reuses the tables.
    let loaded = sys
        .a()
        .query_one_string("SELECT count(*) FROM bench_branches")
        .await?;
    if loaded.as_deref() == Some("0") {
        sys.a()
        .execute(&format!(
            "INSERT INTO bench_branches SELECT b, 0, '' FROM generate_series(1, 2) b;
             INSERT INTO bench_tellers SELECT t, (t - 1) / 10 + 1, 0, '' FROM generate_series(1, 20) t;
             INSERT INTO bench_accounts SELECT a, (a - 1) / {n} + 1, 0, '' FROM generate_series(1, 2 * {n}) a;
             INSERT INTO bench_heartbeat VALUES (0, 0, clock_timestamp()), (1, 0, clock_timestamp());"
        ))
        .await?;
    }
    sys.settle().await?;
    sys.checkpoint().await?;
    let script = workdir.join(format!("tpcb-{}.sql", sys.label()));
    std::fs::write(&script, PGBENCH_SCRIPT)?;

    let phase = Arc::new(AtomicU8::new(PHASE_WARMUP));
    let mut hb = JoinSet::new();
    for i in 0..2usize {
        let writer = sys.nodes[i].connect().await?;
        hb.spawn(heartbeat_writer(
            writer,
            i,
            cfg.heartbeat,
            Arc::clone(&phase),
        ));
    }
    let mut samplers = JoinSet::new();
    for (on, of) in [(1usize, 0usize), (0, 1)] {
        let reader = sys.nodes[on].connect().await?;
        samplers.spawn(lag_sampler(reader, of, cfg.sample, Arc::clone(&phase)));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    phase.store(PHASE_IDLE, Ordering::SeqCst);
    tokio::time::sleep(cfg.idle).await;
    phase.store(PHASE_LOAD, Ordering::SeqCst);
    let bench = tokio::join!(
        pgbench(sys.a(), 0, cfg, &script),
        pgbench(sys.b(), 1, cfg, &script),
    );
    phase.store(PHASE_STOP, Ordering::SeqCst);
    let ended = Instant::now();
    let mut idle = LagSamples::default();
    let mut load = LagSamples::default();
    while let Some(r) = samplers.join_next().await {
        let (i, l) = r.context("lag sampler")??;
        idle.staleness.extend(i.staleness);
        idle.delivery.extend(i.delivery);
        load.staleness.extend(l.staleness);
        load.delivery.extend(l.delivery);
    }
    while let Some(r) = hb.join_next().await {
        r.context("heartbeat writer")??;
    }
    let (s0, s1) = bench;
    let (s0, s1) = (s0?, s1?);
    sys.fence_both_ways(CATCH_UP_TIMEOUT).await?;
    let drain = ended.elapsed();
    // Disjoint keys: no conflicts, so both nodes must hold identical data.
    for sql in [
        "SELECT count(*), sum(abalance) FROM bench_accounts",
        "SELECT count(*), sum(tbalance) FROM bench_tellers",
        "SELECT count(*), sum(bbalance) FROM bench_branches",
        "SELECT count(*), sum(delta) FROM bench_history",
    ] {
        let x = sys.a().query_strings(sql).await?;
        let y = sys.b().query_strings(sql).await?;
        ensure!(x == y, "{}: {sql}: {x:?} on a, {y:?} on b", sys.label());
    }
    Ok(TpcbResult {
        idle,
        load,
        txns: [s0.0, s1.0],
        tps: [s0.1, s1.1],
        drain,
    })
}

/// Updates node `node`'s heartbeat row with the server clock every period.
async fn heartbeat_writer(
    client: Client,
    node: usize,
    period: Duration,
    phase: Arc<AtomicU8>,
) -> Result<()> {
    let node = i32::try_from(node)?;
    let stmt = client
        .prepare(
            "UPDATE bench_heartbeat SET seq = seq + 1, sent = clock_timestamp() WHERE node = $1",
        )
        .await?;
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while phase.load(Ordering::SeqCst) != PHASE_STOP {
        tick.tick().await;
        client.execute(&stmt, &[&node]).await?;
    }
    Ok(())
}

/// Reads node `of`'s heartbeat row through `client` every period; returns
/// the samples of the idle and the load phase.
async fn lag_sampler(
    client: Client,
    of: usize,
    period: Duration,
    phase: Arc<AtomicU8>,
) -> Result<(LagSamples, LagSamples)> {
    let of = i32::try_from(of)?;
    // Both clocks are this machine's: the difference is the lag itself.
    let stmt = client
        .prepare(
            "SELECT seq, (extract(epoch FROM clock_timestamp() - sent) * 1000)::float8 \
             FROM bench_heartbeat WHERE node = $1",
        )
        .await?;
    let mut idle = LagSamples::default();
    let mut load = LagSamples::default();
    let mut last_seq: Option<i64> = None;
    let mut rng = Jitter::new(of as u64);
    loop {
        // Uniformly jittered around the period: with a fixed period equal
        // to the heartbeat's, samples would lock onto one phase of the
        // heartbeat cycle and measure that offset instead of the lag.
        tokio::time::sleep(period.mul_f64(rng.next_factor())).await;
        let p = phase.load(Ordering::SeqCst);
        if p == PHASE_STOP {
            return Ok((idle, load));
        }
        let Some(row) = client.query_opt(&stmt, &[&of]).await? else {
            bail!("heartbeat row of node {of} is missing");
        };
        let seq: i64 = row.try_get(0)?;
        let ms: f64 = row.try_get(1)?;
        let new = last_seq.is_some_and(|l| seq > l);
        let first = last_seq.is_none();
        last_seq = Some(last_seq.map_or(seq, |l| l.max(seq)));
        let target = match p {
            PHASE_IDLE => &mut idle,
            PHASE_LOAD => &mut load,
            _ => continue,
        };
        if first {
            continue;
        }
        target.staleness.push(ms);
        if new {
            target.delivery.push(ms);
        }
    }
}

/// xorshift64: sampling jitter needs no crate and no quality beyond "not
/// periodic".
struct Jitter(u64);

impl Jitter {
    fn new(salt: u64) -> Jitter {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos() as u64);
        Jitter((nanos ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1)
    }

    /// A factor uniformly distributed in [0.5, 1.5).
    fn next_factor(&mut self) -> f64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        0.5 + (x >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Runs pgbench against `node` for the configured time; returns (processed
/// transactions, tps).
async fn pgbench(node: &PgNode, i: usize, cfg: &TpcbConfig, script: &Path) -> Result<(u64, f64)> {
    let bin: PathBuf = pg_bin_dir()?.join("pgbench");
    let n = cfg.accounts;
    let mut cmd = tokio::process::Command::new(&bin);
    cmd.args([
        "-h",
        node.host(),
        "-p",
        &node.port().to_string(),
        "-U",
        "postgres",
    ])
    .args(["-n", "-M", "prepared"])
    .args(["-c", &cfg.clients.to_string(), "-j", "1"])
    .args(["-T", &cfg.seconds.to_string()])
    .arg("-f")
    .arg(script)
    .args(["-D", &format!("node={i}")])
    .args(["-D", &format!("bid={}", i + 1)])
    .args(["-D", &format!("toff={}", i * 10)])
    .args(["-D", &format!("aoff={}", i as u64 * n)])
    .args(["-D", &format!("naccounts={n}")]);
    if cfg.rate > 0 {
        cmd.args(["-R", &cfg.rate.to_string()]);
    }
    cmd.arg("postgres");
    let out = cmd
        .output()
        .await
        .with_context(|| format!("running {}", bin.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "pgbench on {} failed ({}): {}{}",
            node.name(),
            out.status,
            stdout,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let field = |prefix: &str| -> Option<f64> {
        stdout
            .lines()
            .find_map(|l| l.trim().strip_prefix(prefix))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.split('/').next())
            .and_then(|v| v.parse().ok())
    };
    let txns = field("number of transactions actually processed:")
        .with_context(|| format!("pgbench output without a transaction count:\n{stdout}"))?;
    let tps = field("tps =").with_context(|| format!("pgbench output without tps:\n{stdout}"))?;
    Ok((txns as u64, tps))
}

/// The p-th percentile (nearest rank) of `v`; NaN when empty.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * s.len() as f64).ceil() as usize;
    s[rank.clamp(1, s.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 100.0), 100.0);
        assert_eq!(percentile(&[7.0], 95.0), 7.0);
        assert!(percentile(&[], 50.0).is_nan());
    }
}
