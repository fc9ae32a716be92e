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

use mm_tests::agent::{AgentProcess, Secrets, mmctl};
use mm_tests::{PgNode, pg_bin_dir};

pub mod backlog;
pub mod resources;

pub use resources::Resources;

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
-- The conflicts workload: node i's keys in t_disjoint, everybody's in t_hot.
CREATE TABLE t_disjoint (id bigint PRIMARY KEY, n bigint NOT NULL, src int NOT NULL, v text NOT NULL);
CREATE TABLE t_hot (id bigint PRIMARY KEY, n bigint NOT NULL, src int NOT NULL, v text NOT NULL);
";

const TABLES: &str = "bench_fence, t_insert, t_bulk, t_update, bench_branches, bench_tellers, \
                      bench_accounts, bench_history, bench_heartbeat, t_disjoint, t_hot, \
                      bl_ins1, bl_upd1, bl_del1, bl_updins, bl_updins_h, bl_ins1000, bl_one, bl_streamed";

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

    pub(crate) async fn mmctl(&self, args: &[&str]) -> Result<String> {
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

    /// Moves the restart point of every slot on node A past everything
    /// written so far, so that a backlog run's walsender decodes the
    /// backlog only. A slot restarts decoding at the last running-xacts
    /// record its subscriber confirmed past, and the background writer
    /// logs one every 15 s: without this, whether a run re-decoded the
    /// previous setup (17-39 MB of WAL, 0.2-0.6 s of walsender CPU in
    /// 100k-row runs) was luck, for either system.
    pub(crate) async fn advance_slots(&self) -> Result<()> {
        // A restart point this close is as good as there: the record it
        // restarts at may start just before the position read first.
        const SLOT_SLACK: u64 = 1 << 20;
        let a = self.a();
        let target = a
            .query_one_string("SELECT pg_current_wal_insert_lsn()::text")
            .await?
            .context("no WAL position")?;
        a.execute("SELECT pg_log_standby_snapshot()").await?;
        // A commit after the record, which the subscriber then confirms.
        self.settle().await?;
        let behind = format!(
            "SELECT count(*) FROM pg_replication_slots \
             WHERE restart_lsn < '{target}'::pg_lsn - {SLOT_SLACK}"
        );
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if a.query_one_string(&behind).await?.as_deref() == Some("0") {
                return Ok(());
            }
            if Instant::now() > deadline {
                eprintln!(
                    "warning: {}: a slot on {} did not move past {target}; this run may decode older WAL",
                    self.label(),
                    a.name()
                );
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
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
    pub(crate) async fn delivered(
        &self,
        start: Instant,
        check_sql: &str,
        want: &str,
    ) -> Result<Duration> {
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
        node.execute(&format!("{SCHEMA}{}", backlog::SCHEMA))
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
    /// From the start of the workload until the subscriber had every row.
    pub res: Resources,
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
pub(crate) async fn open_clients(
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
pub(crate) async fn drive(
    clients: Vec<(Client, tokio_postgres::Statement)>,
    total: u64,
) -> Result<()> {
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
    let check = "SELECT count(*) FROM t_insert";
    timed(sys, rows, drive(conns, rows), check, &rows.to_string()).await
}

/// Runs `work` on the publisher (after a checkpoint) and times it until the
/// subscriber answers `check` with `want`, sampling CPU and RSS meanwhile.
/// `work` is not polled before the clock starts.
async fn timed(
    sys: &System,
    rows: u64,
    work: impl std::future::Future<Output = Result<()>>,
    check: &str,
    want: &str,
) -> Result<Measured> {
    sys.checkpoint().await?;
    let sampler = resources::Sampler::start(sys).await?;
    let start = Instant::now();
    work.await?;
    let load = start.elapsed();
    let total = sys.delivered(start, check, want).await?;
    let res = sampler.stop().await?;
    Ok(Measured {
        rows,
        load,
        total,
        res,
    })
}

/// Workload 2: one transaction inserting `rows` rows on node a.
pub async fn one_big_insert(sys: &System, rows: u64) -> Result<Measured> {
    let client = sys.a().connect().await?;
    let sql = format!(
        "INSERT INTO t_bulk (id, n, v) SELECT g, g, md5(g::text) FROM generate_series(1, {rows}) g"
    );
    let work = async { Ok(client.batch_execute(&sql).await?) };
    let check = "SELECT count(*) FROM t_bulk";
    timed(sys, rows, work, check, &rows.to_string()).await
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
    let check = "SELECT sum(n)::bigint FROM t_update";
    timed(sys, rows, drive(conns, rows), check, &rows.to_string()).await
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
    /// The stream into node B (A's writes) from the start of the load until
    /// both nodes had everything, as the conflicts workload reports it.
    pub res: resources::Resources,
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
             INSERT INTO bench_accounts SELECT a, (a - 1) / {n} + 1, 0, '' FROM generate_series(1, 2 * {n}) a;"
        ))
        .await?;
    }
    ensure_heartbeat_rows(sys).await?;
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
    let cpu = resources::Sampler::start(sys).await?;
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
    let res = cpu.stop().await?;
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
        res,
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

    fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// A factor uniformly distributed in [0.5, 1.5).
    fn next_factor(&mut self) -> f64 {
        0.5 + (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
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

/// The heartbeat rows the lag samplers read, one per node, each inserted on
/// the node that updates it (so it never changes origin) unless already
/// there.
async fn ensure_heartbeat_rows(sys: &System) -> Result<()> {
    for (i, n) in sys.nodes.iter().enumerate() {
        n.execute(&format!(
            "INSERT INTO bench_heartbeat VALUES ({i}, 0, clock_timestamp()) ON CONFLICT (node) DO NOTHING"
        ))
        .await?;
    }
    Ok(())
}

/// Which keys the two nodes update in the conflicts workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeySet {
    /// Node 0 updates keys 1..=K, node 1 keys K+1..=2K: never the same row,
    /// so no conflicts; the baseline.
    Disjoint,
    /// Both nodes update keys 1..=H at once: the same row is often updated
    /// on both nodes within one replication delay.
    Hot,
}

impl KeySet {
    pub fn label(self) -> &'static str {
        match self {
            KeySet::Disjoint => "disjoint keys",
            KeySet::Hot => "hot keys",
        }
    }

    fn table(self) -> &'static str {
        match self {
            KeySet::Disjoint => "t_disjoint",
            KeySet::Hot => "t_hot",
        }
    }
}

/// Settings of the conflicts workload.
#[derive(Debug, Clone)]
pub struct ConflictConfig {
    /// Connections per node.
    pub clients: usize,
    /// Single-row UPDATE transactions per connection.
    pub txns: u64,
    /// Keys per node of the disjoint run.
    pub disjoint_keys: u64,
    /// Keys shared by both nodes in the hot run.
    pub hot_keys: u64,
    pub sync_commit: bool,
    pub heartbeat: Duration,
    pub sample: Duration,
}

/// Conflict counters of one system, summed over both directions.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConflictCounters {
    /// By conflict type name (PostgreSQL 18's names, used by both systems).
    pub by_type: std::collections::BTreeMap<String, u64>,
    /// mm: the status `routine` counter (cross-origin changes that were not
    /// concurrent), when the agent reports it.
    pub routine: Option<u64>,
    /// mm: transactions applied by both streams.
    pub applied_txns: Option<u64>,
    /// mm: fast-path attempts rolled back for a conflict
    /// (`conflict_rollbacks`) and conflicts settled in place
    /// (`conflicts_in_place`): how conflicts were paid for.
    pub rollbacks: Option<u64>,
    pub in_place: Option<u64>,
    /// Streams (mm) or subscriptions (native) not healthy, with their error.
    pub errors: Vec<String>,
}

impl ConflictCounters {
    pub fn total(&self) -> u64 {
        self.by_type.values().sum()
    }

    /// `self - before`, per counter (counters only grow while a process runs).
    fn since(&self, before: &ConflictCounters) -> ConflictCounters {
        let by_type = self
            .by_type
            .iter()
            .map(|(k, v)| {
                let b = before.by_type.get(k).copied().unwrap_or(0);
                (k.clone(), v.saturating_sub(b))
            })
            .filter(|(_, v)| *v > 0)
            .collect();
        let sub = |a: Option<u64>, b: Option<u64>| a.map(|a| a.saturating_sub(b.unwrap_or(0)));
        ConflictCounters {
            by_type,
            routine: sub(self.routine, before.routine),
            applied_txns: sub(self.applied_txns, before.applied_txns),
            rollbacks: sub(self.rollbacks, before.rollbacks),
            in_place: sub(self.in_place, before.in_place),
            errors: self.errors.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct ConflictResult {
    pub keys: KeySet,
    /// Rows in the table (keys updated).
    pub rows: u64,
    /// Update transactions committed by the writers, both nodes together.
    pub txns: u64,
    /// From the start until the last writer on either node finished.
    pub writers: Duration,
    /// From the start until each node held everything the other wrote.
    pub converged: Duration,
    /// Heartbeat lag while the writers ran, both directions pooled.
    pub lag: LagSamples,
    /// Counter deltas over the run (mm: `mmctl status --json`; native:
    /// `pg_stat_subscription_stats`, which counts every change to a row last
    /// written by another origin, concurrent or not, and always applies it).
    pub conflicts: ConflictCounters,
    /// Rows whose contents differ between the two nodes at the end.
    pub differing_rows: u64,
    /// CPU of the stream into node b (its agent and apply backends, a's
    /// walsenders) from the start until converged; the other direction is
    /// symmetric.
    pub res: resources::Resources,
    /// sum(n) on each node: every committed update adds 1 where it ran; an
    /// update overwritten by a concurrent one on the other node is lost.
    pub sums: [i64; 2],
}

impl ConflictResult {
    /// Update transactions per second of the writers.
    pub fn writer_tps(&self) -> f64 {
        self.txns as f64 / self.writers.as_secs_f64().max(1e-9)
    }

    /// Update transactions per second until both nodes had everything.
    pub fn converged_tps(&self) -> f64 {
        self.txns as f64 / self.converged.as_secs_f64().max(1e-9)
    }

    /// Detected conflicts per replicated workload transaction.
    pub fn conflict_rate(&self) -> f64 {
        self.conflicts.total() as f64 / (self.txns as f64).max(1.0)
    }
}

impl System {
    /// The conflict counters of the system now, both directions summed.
    pub async fn conflict_counters(&self) -> Result<ConflictCounters> {
        match self.kind {
            Kind::Mm => {
                let out = self.mmctl(&["status", "--json"]).await?;
                let v: serde_json::Value = serde_json::from_str(&out)
                    .with_context(|| format!("mmctl status --json is not JSON: {out}"))?;
                Ok(mm_counters(&v))
            }
            Kind::Native => {
                let mut c = ConflictCounters::default();
                for n in &self.nodes {
                    for row in n
                        .query_strings(
                            "SELECT s.subname, to_jsonb(s)::text FROM pg_stat_subscription_stats s",
                        )
                        .await?
                    {
                        let name = row.first().cloned().flatten().unwrap_or_default();
                        let json = row.get(1).cloned().flatten().unwrap_or_default();
                        let v: serde_json::Value = serde_json::from_str(&json)?;
                        native_counters(&mut c, n.name(), &name, &v);
                    }
                }
                Ok(c)
            }
        }
    }

    /// PostgreSQL's apply workers publish their counters lazily (at most
    /// about once a second, when idle): read until two reads a second
    /// apart agree. mm's counters are live.
    async fn settled_conflict_counters(&self) -> Result<ConflictCounters> {
        let mut last = self.conflict_counters().await?;
        if self.kind == Kind::Mm {
            return Ok(last);
        }
        for _ in 0..5 {
            tokio::time::sleep(Duration::from_millis(1100)).await;
            let now = self.conflict_counters().await?;
            if now == last {
                break;
            }
            last = now;
        }
        Ok(last)
    }
}

/// Sums the per-stream counters of `mmctl status --json`: every object that
/// names `from`, `to` and `state` is one stream. `routine` is read when the
/// agent reports it (added with conflict handling).
fn mm_counters(v: &serde_json::Value) -> ConflictCounters {
    let mut c = ConflictCounters::default();
    let mut stack = vec![v];
    while let Some(x) = stack.pop() {
        match x {
            serde_json::Value::Object(m) => {
                let name = |k: &str| m.get(k).and_then(|v| v.as_str());
                if let (Some(from), Some(to), Some(state)) =
                    (name("from"), name("to"), name("state"))
                {
                    if let Some(conf) = m.get("conflicts").and_then(|v| v.as_object()) {
                        for (k, n) in conf {
                            *c.by_type.entry(k.clone()).or_default() += n.as_u64().unwrap_or(0);
                        }
                    }
                    if let Some(n) = m.get("routine").and_then(|v| v.as_u64()) {
                        *c.routine.get_or_insert(0) += n;
                    }
                    for (key, counter) in [
                        ("applied_txns", &mut c.applied_txns),
                        ("conflict_rollbacks", &mut c.rollbacks),
                        ("conflicts_in_place", &mut c.in_place),
                    ] {
                        if let Some(n) = m.get(key).and_then(|v| v.as_u64()) {
                            *counter.get_or_insert(0) += n;
                        }
                    }
                    if state != "streaming" {
                        let err = name("last_error").unwrap_or("");
                        c.errors.push(format!("{from} -> {to}: {state} {err}"));
                    }
                    continue;
                }
                stack.extend(m.values());
            }
            serde_json::Value::Array(a) => stack.extend(a.iter()),
            _ => {}
        }
    }
    c
}

/// Adds one `pg_stat_subscription_stats` row (as JSON) to `c`: the
/// `confl_*` columns (PostgreSQL 18) by type, `apply_error_count` as an error.
fn native_counters(c: &mut ConflictCounters, node: &str, sub: &str, v: &serde_json::Value) {
    let Some(m) = v.as_object() else { return };
    for (k, n) in m {
        if let Some(t) = k.strip_prefix("confl_") {
            *c.by_type.entry(t.to_owned()).or_default() += n.as_u64().unwrap_or(0);
        }
    }
    if let Some(n) = m.get("apply_error_count").and_then(|v| v.as_u64())
        && n > 0
    {
        c.errors
            .push(format!("{node} subscription {sub}: {n} apply errors"));
    }
}

/// Workload 5: `clients` connections on EACH node run `txns` single-row
/// UPDATE transactions each, all at once, on disjoint key ranges or on one
/// shared hot key set; heartbeats measure the lag each way meanwhile. Both
/// systems get the same driver. Divergence is measured and returned, not
/// treated as a failure, except on disjoint keys where it would be a bug.
pub async fn conflicting_updates(
    sys: &System,
    keys: KeySet,
    cfg: &ConflictConfig,
) -> Result<ConflictResult> {
    let table = keys.table();
    let (rows, ranges) = match keys {
        KeySet::Disjoint => {
            let k = cfg.disjoint_keys.max(1);
            (2 * k, [(1, k), (k + 1, 2 * k)])
        }
        KeySet::Hot => {
            let h = cfg.hot_keys.max(1);
            (h, [(1, h), (1, h)])
        }
    };
    let loaded = sys
        .a()
        .query_one_string(&format!("SELECT count(*) FROM {table}"))
        .await?;
    ensure!(
        loaded.as_deref() == Some("0"),
        "{}: {table} is not empty ({loaded:?} rows): the conflicts workload runs once per system",
        sys.label()
    );
    // Each node inserts the keys it will update (the hot set: node a), so on
    // disjoint keys every row is only ever written by one origin.
    match keys {
        KeySet::Disjoint => {
            for (i, (lo, hi)) in ranges.iter().enumerate() {
                sys.nodes[i]
                    .execute(&format!(
                        "INSERT INTO {table} (id, n, src, v) SELECT g, 0, {i}, '' FROM generate_series({lo}, {hi}) g"
                    ))
                    .await?;
            }
        }
        KeySet::Hot => {
            sys.a()
                .execute(&format!(
                    "INSERT INTO {table} (id, n, src, v) SELECT g, 0, 0, '' FROM generate_series(1, {rows}) g"
                ))
                .await?;
        }
    }
    ensure_heartbeat_rows(sys).await?;
    sys.settle().await?;
    for n in &sys.nodes {
        let got = n
            .query_one_string(&format!("SELECT count(*) FROM {table}"))
            .await?;
        ensure!(
            got.as_deref() == Some(rows.to_string().as_str()),
            "{}: preload of {table} on {} has {got:?} rows, want {rows}",
            sys.label(),
            n.name()
        );
    }

    let sql = format!("UPDATE {table} SET n = n + 1, src = $2, v = $3 WHERE id = $1");
    let mut conns = Vec::new();
    for i in 0..2 {
        conns.push(open_clients(&sys.nodes[i], cfg.clients, cfg.sync_commit, &sql).await?);
    }
    let before = sys.conflict_counters().await?;
    sys.checkpoint().await?;

    let phase = Arc::new(AtomicU8::new(PHASE_LOAD));
    let mut hb = JoinSet::new();
    let mut samplers = JoinSet::new();
    let cpu = resources::Sampler::start(sys).await?;
    for (on, of) in [(1usize, 0usize), (0, 1)] {
        let writer = sys.nodes[of].connect().await?;
        hb.spawn(heartbeat_writer(
            writer,
            of,
            cfg.heartbeat,
            Arc::clone(&phase),
        ));
        let reader = sys.nodes[on].connect().await?;
        samplers.spawn(lag_sampler(reader, of, cfg.sample, Arc::clone(&phase)));
    }

    let start = Instant::now();
    let mut writers = JoinSet::new();
    for (i, clients) in conns.into_iter().enumerate() {
        let (lo, hi) = ranges[i];
        for (k, (client, stmt)) in clients.into_iter().enumerate() {
            let txns = cfg.txns;
            writers.spawn(async move {
                let src = i32::try_from(i)?;
                let mut rng = Jitter::new((i * 1000 + k) as u64 + 1);
                let span = hi - lo + 1;
                for j in 0..txns {
                    let id = i64::try_from(lo + rng.next_u64() % span)?;
                    let v = format!("{i}.{k}.{j}");
                    let n = client.execute(&stmt, &[&id, &src, &v]).await?;
                    ensure!(n == 1, "update of key {id} on node {i} touched {n} rows");
                }
                Ok::<_, anyhow::Error>(())
            });
        }
    }
    let mut failed = None;
    while let Some(r) = writers.join_next().await {
        if let Err(e) = r.context("writer task").and_then(|r| r) {
            failed.get_or_insert(e);
        }
    }
    let writers_done = start.elapsed();
    phase.store(PHASE_STOP, Ordering::SeqCst);
    let mut lag = LagSamples::default();
    while let Some(r) = samplers.join_next().await {
        let (_, l) = r.context("lag sampler")??;
        lag.staleness.extend(l.staleness);
        lag.delivery.extend(l.delivery);
    }
    while let Some(r) = hb.join_next().await {
        r.context("heartbeat writer")??;
    }
    if let Some(e) = failed {
        return Err(e.context(format!("{}: {} writers", sys.label(), keys.label())));
    }
    // Each node's writes committed before its fence; both appliers apply an
    // origin in commit order, so each fence arriving means all of it did.
    sys.fence_both_ways(Duration::from_secs(300)).await?;
    let converged = start.elapsed();
    let res = cpu.stop().await?;
    sys.settle().await?;
    let conflicts = sys.settled_conflict_counters().await?.since(&before);

    let select = format!("SELECT id, n, src, v FROM {table} ORDER BY id");
    let x = sys.a().query_strings(&select).await?;
    let y = sys.b().query_strings(&select).await?;
    let differing_rows = count_differing(&x, &y);
    let mut sums = [0i64; 2];
    for (i, n) in sys.nodes.iter().enumerate() {
        sums[i] = n
            .query_one_string(&format!("SELECT coalesce(sum(n), 0)::bigint FROM {table}"))
            .await?
            .unwrap_or_default()
            .parse()
            .context("sum(n)")?;
    }
    let txns = 2 * cfg.clients.max(1) as u64 * cfg.txns;
    if keys == KeySet::Disjoint {
        ensure!(
            differing_rows == 0 && sums == [txns as i64; 2],
            "{}: disjoint keys, yet the nodes differ: {differing_rows} rows differ, sum(n) {sums:?}, want {txns}",
            sys.label()
        );
    }
    Ok(ConflictResult {
        keys,
        rows,
        txns,
        writers: writers_done,
        converged,
        lag,
        conflicts,
        differing_rows,
        sums,
        res,
    })
}

/// Rows present on one side only, or with different contents; both lists
/// are sorted by their first column (the key).
fn count_differing(a: &[Vec<Option<String>>], b: &[Vec<Option<String>>]) -> u64 {
    let a: std::collections::BTreeMap<_, _> = a
        .iter()
        .map(|r| (r.first().cloned().flatten(), r))
        .collect();
    let b: std::collections::BTreeMap<_, _> = b
        .iter()
        .map(|r| (r.first().cloned().flatten(), r))
        .collect();
    let mut n = 0;
    for (k, r) in &a {
        if b.get(k) != Some(r) {
            n += 1;
        }
    }
    n + b.keys().filter(|k| !a.contains_key(*k)).count() as u64
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
    use super::{ConflictCounters, count_differing, mm_counters, native_counters, percentile};

    #[test]
    fn mm_status_counters_with_and_without_routine() {
        let v = serde_json::json!({
            "agent": "http://x",
            "nodes": [{"name": "b1", "state": "active"}],
            "pairs": [
                {"from": "b1", "to": "b2", "state": "streaming", "applied_txns": 10,
                 "conflicts": {"update_origin_differs": 3, "update_missing": 1}, "routine": 5,
                 "conflict_rollbacks": 2, "conflicts_in_place": 1},
                {"from": "b2", "to": "b1", "state": "error", "last_error": "boom",
                 "applied_txns": 7, "conflicts": {"update_origin_differs": 2}},
            ],
        });
        let c = mm_counters(&v);
        assert_eq!(c.total(), 6);
        assert_eq!(c.by_type["update_origin_differs"], 5);
        assert_eq!(c.routine, Some(5));
        assert_eq!(c.applied_txns, Some(17));
        assert_eq!((c.rollbacks, c.in_place), (Some(2), Some(1)));
        assert_eq!(c.errors, vec!["b2 -> b1: error boom".to_owned()]);
        let old = serde_json::json!({"pairs": [
            {"from": "b1", "to": "b2", "state": "streaming", "applied_txns": 1, "conflicts": {}}]});
        assert_eq!(mm_counters(&old).routine, None);
        let d = c.since(&ConflictCounters {
            applied_txns: Some(7),
            routine: Some(1),
            ..Default::default()
        });
        assert_eq!(
            (d.applied_txns, d.routine, d.total()),
            (Some(10), Some(4), 6)
        );
    }

    #[test]
    fn native_counters_read_confl_columns() {
        let mut c = ConflictCounters::default();
        let row = serde_json::json!({"subid": 1, "subname": "s", "apply_error_count": 0,
            "confl_update_origin_differs": 4, "confl_insert_exists": 1});
        native_counters(&mut c, "na", "s", &row);
        native_counters(&mut c, "nb", "s", &row);
        assert_eq!(c.total(), 10);
        assert!(c.errors.is_empty());
    }

    #[test]
    fn differing_rows_by_key() {
        let r = |k: &str, v: &str| vec![Some(k.to_owned()), Some(v.to_owned())];
        let a = vec![r("1", "x"), r("2", "y"), r("3", "z")];
        let b = vec![r("1", "x"), r("2", "Y"), r("4", "w")];
        assert_eq!(count_differing(&a, &a), 0);
        assert_eq!(count_differing(&a, &b), 3);
    }

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
