//! A whole test cluster: PostgreSQL nodes, one agent each, formed with mmctl.

use std::io::Read;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};

use crate::agent::{AgentProcess, MmctlOutput, Secrets, mmctl};
use crate::{PgNode, PgOptions};

pub type Rows = Vec<Vec<Option<String>>>;

/// Everything a test may vary about a cluster (see `TestCluster::start_opts`).
#[derive(Clone, Default)]
pub struct ClusterOptions {
    /// PostgreSQL options for every node.
    pub pg: PgOptions,
    /// TOML appended to every agent's config (e.g. a `[conflicts]` section).
    pub agent_toml: String,
    /// The agent binary (e.g. `mm-agent-custom`); `None`: `mm-agent`.
    pub agent_bin: Option<PathBuf>,
}

pub struct TestCluster {
    pub pg: Vec<PgNode>,
    pub agents: Vec<AgentProcess>,
    pub secrets: Secrets,
    _dir: tempfile::TempDir,
}

fn random_token() -> Result<String> {
    let mut buf = [0u8; 24];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut buf)?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

impl TestCluster {
    /// Starts `names.len()` PostgreSQL nodes, runs `schema_sql` on each (the
    /// replicated tables must exist everywhere, empty), starts an agent beside
    /// each, `mmctl init` on the first and `mmctl add-node` for the others.
    pub async fn start(names: &[&str], schema_sql: &str) -> Result<TestCluster> {
        Self::start_with(names, schema_sql, PgOptions::default()).await
    }

    /// Like `start`, with PostgreSQL options for every node.
    pub async fn start_with(
        names: &[&str],
        schema_sql: &str,
        opts: PgOptions,
    ) -> Result<TestCluster> {
        let mut c = Self::start_unformed(names, schema_sql, opts).await?;
        c.form().await?;
        Ok(c)
    }

    /// Like `start`, with agent config additions and another agent binary.
    pub async fn start_opts(
        names: &[&str],
        schema_sql: &str,
        opts: ClusterOptions,
    ) -> Result<TestCluster> {
        let mut c = Self::start_unformed_opts(names, schema_sql, opts).await?;
        c.form().await?;
        Ok(c)
    }

    /// Nodes and agents running, but no cluster formed yet.
    pub async fn start_unformed(
        names: &[&str],
        schema_sql: &str,
        opts: PgOptions,
    ) -> Result<TestCluster> {
        Self::start_unformed_opts(
            names,
            schema_sql,
            ClusterOptions {
                pg: opts,
                ..ClusterOptions::default()
            },
        )
        .await
    }

    /// `start_unformed` with every option.
    pub async fn start_unformed_opts(
        names: &[&str],
        schema_sql: &str,
        cluster_opts: ClusterOptions,
    ) -> Result<TestCluster> {
        let opts = cluster_opts.pg.clone();
        let dir = tempfile::tempdir()?;
        let token_file = dir.path().join("token");
        std::fs::write(&token_file, random_token()?)?;
        let secrets = Secrets { token_file };
        let mut pg = Vec::new();
        for n in names {
            let node = PgNode::start_with(n, opts.clone())?;
            if !schema_sql.is_empty() {
                node.execute(schema_sql)
                    .await
                    .with_context(|| format!("schema on {n}"))?;
            }
            pg.push(node);
        }
        let mut agents = Vec::new();
        for (n, node) in names.iter().zip(&pg) {
            agents.push(AgentProcess::spawn_bin(
                n,
                node,
                &secrets,
                &[],
                &cluster_opts.agent_toml,
                cluster_opts.agent_bin.clone(),
            )?);
        }
        for a in &mut agents {
            a.wait_ready(Duration::from_secs(30)).await?;
        }
        Ok(TestCluster {
            pg,
            agents,
            secrets,
            _dir: dir,
        })
    }

    /// `mmctl init` on node 0, then `add-node` for every other node.
    pub async fn form(&mut self) -> Result<()> {
        self.mmctl(0, &["init"]).await?.ok()?;
        for i in 1..self.agents.len() {
            let name = self.agents[i].name.clone();
            let url = self.agents[i].url();
            self.mmctl(0, &["add-node", "--name", &name, "--url", &url])
                .await?
                .ok()
                .with_context(|| format!("add-node {name}"))?;
        }
        Ok(())
    }

    pub fn token_file(&self) -> PathBuf {
        self.secrets.token_file.clone()
    }

    /// Runs mmctl against agent `i`.
    pub async fn mmctl(&self, i: usize, args: &[&str]) -> Result<MmctlOutput> {
        mmctl(&self.agents[i].url(), &self.secrets.token_file, args).await
    }

    /// `mmctl wait-sync`, failing with the agents' log tails on timeout.
    pub async fn wait_sync(&self, timeout_secs: u64) -> Result<()> {
        self.wait_sync_args(timeout_secs, &[]).await
    }

    /// `mmctl wait-sync --ignore-paused`: for tests that hold a stream
    /// paused on purpose while the others catch up.
    pub async fn wait_sync_ignore_paused(&self, timeout_secs: u64) -> Result<()> {
        self.wait_sync_args(timeout_secs, &["--ignore-paused"])
            .await
    }

    async fn wait_sync_args(&self, timeout_secs: u64, extra: &[&str]) -> Result<()> {
        let t = timeout_secs.to_string();
        let mut args = vec!["wait-sync", "--timeout", &t];
        args.extend_from_slice(extra);
        let out = self.mmctl(0, &args).await?;
        if !out.success() {
            let mut logs = String::new();
            for a in &self.agents {
                logs.push_str(&format!("\n--- agent {} ---\n{}", a.name, a.log_tail(25)));
            }
            bail!("wait-sync failed: {}{}{logs}", out.stderr, out.stdout);
        }
        Ok(())
    }

    /// Runs a query on node `i` and returns the rows as text.
    pub async fn rows(&self, i: usize, sql: &str) -> Result<Rows> {
        self.pg[i].query_strings(sql).await
    }

    /// The one value of `sql` on node `i`, as an integer.
    pub async fn value(&self, i: usize, sql: &str) -> Result<i64> {
        let r = self.rows(i, sql).await?;
        let v = r
            .first()
            .and_then(|row| row.first().cloned())
            .flatten()
            .with_context(|| format!("{sql}: no value"))?;
        v.parse().with_context(|| format!("{sql}: {v}"))
    }

    /// The batch procedures (`apply/batch.rs`) node `i`'s apply sessions
    /// created: temporary procedures `pg_temp_N.mm_batch_K`.
    pub async fn batch_procedures(&self, i: usize) -> Result<i64> {
        self.value(
            i,
            "SELECT count(*) FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n \
             ON n.oid = p.pronamespace WHERE n.nspname LIKE 'pg\\_temp\\_%' AND p.proname LIKE 'mm\\_batch\\_%'",
        )
        .await
    }

    /// Runs each statement as its own transaction on node `i`.
    pub async fn run_each(&self, i: usize, stmts: &[String]) -> Result<()> {
        let client = self.pg[i].connect().await?;
        for s in stmts {
            client.batch_execute(s).await.with_context(|| s.clone())?;
        }
        Ok(())
    }

    /// 3000 single-row transactions on node 0 (inserts of ids 1..2000 into
    /// `items (id, v)`, updates of 1..600, deletes of 1501..1900 but 1888)
    /// wait behind paused streams; node 1 wrote two of the inserted keys
    /// earlier. After resuming: identical nodes with node 0's newer rows,
    /// exactly two conflicts on node 1, every transaction counted once by
    /// the stream `from` -> `to` and in its progress row. Returns the rows.
    pub async fn a_backlog_with_two_conflicts(&self, from: &str, to: &str) -> Result<Rows> {
        let applied = |s: &serde_json::Value| {
            s.get("applied_txns")
                .and_then(serde_json::Value::as_u64)
                .unwrap_or(0)
        };
        self.pause(from, to).await?;
        self.pause(to, from).await?;
        // Older than the publisher's inserts of the same keys: they lose.
        self.run_each(
            1,
            &[
                "INSERT INTO items VALUES (777, -1)".to_owned(),
                "INSERT INTO items VALUES (1888, -1)".to_owned(),
            ],
        )
        .await?;
        let before = applied(&self.stream_status(from, to).await?);
        let mut stmts: Vec<String> = (1..=2000)
            .map(|id| format!("INSERT INTO items VALUES ({id}, {id})"))
            .collect();
        stmts.extend((1..=600).map(|id| format!("UPDATE items SET v = v + 1 WHERE id = {id}")));
        stmts.extend(
            (1501..=1900)
                .filter(|id| *id != 1888)
                .map(|id| format!("DELETE FROM items WHERE id = {id}")),
        );
        self.run_each(0, &stmts).await?;
        self.resume(from, to).await?;
        self.resume(to, from).await?;
        self.wait_sync(120).await?;

        let rows = self
            .assert_same("SELECT id, v FROM items ORDER BY id")
            .await?;
        // 2000 inserted, 399 deleted (1888 kept, 1900 included).
        ensure!(rows.len() == 1601, "{} rows", rows.len());
        for (id, v) in [(777, 777), (1888, 1888), (5, 6), (601, 601)] {
            let got = self
                .value(1, &format!("SELECT v FROM items WHERE id = {id}"))
                .await?;
            ensure!(got == v, "id {id}: v = {got}, want {v}");
        }
        let conflicts = self
            .value(1, "SELECT count(*) FROM mm.conflict_log")
            .await?;
        ensure!(
            conflicts == 2,
            "{conflicts} conflicts logged on {to}, want 2"
        );
        // Every remote transaction counted once (the two of the subscriber
        // are counted by the other stream).
        let after = applied(&self.stream_status(from, to).await?);
        let n = stmts.len() as u64;
        ensure!(
            after - before == n,
            "status counts {} applied transactions, want {n}",
            after - before
        );
        let stored = self
            .value(
                1,
                &format!("SELECT applied_txns FROM mm.apply_progress WHERE origin LIKE '%{from}%'"),
            )
            .await?;
        ensure!(stored as u64 >= n, "progress counts {stored}, want >= {n}");
        Ok(rows)
    }

    /// A CHECK constraint only node 1 has (`v <> 25` on `items (id, v)`)
    /// stops the stream from node 0 at the row that violates it, in the
    /// middle of a backlog of 50 single-row INSERT transactions (paused
    /// stream `from` -> `to`): the error must name that transaction, the
    /// 24 before it must be applied and none after it; once the
    /// constraint is dropped, all 50 are, and the nodes are identical.
    pub async fn an_error_in_a_backlog_names_its_transaction(
        &self,
        from: &str,
        to: &str,
    ) -> Result<()> {
        self.pg[1]
            .execute("ALTER TABLE items ADD CONSTRAINT not_25 CHECK (v <> 25)")
            .await?;
        self.pause(from, to).await?;
        let writer = self.pg[0].connect().await?;
        let mut failing = String::new();
        for id in 1..=50 {
            let row = writer
                .query_one(
                    &format!("INSERT INTO items VALUES ({id}, {id}) RETURNING xmin::text"),
                    &[],
                )
                .await?;
            if id == 25 {
                failing = row.get(0);
            }
        }
        self.resume(from, to).await?;
        let s = self
            .wait_stream(from, to, "error", &["not_25"], Duration::from_secs(60))
            .await?;
        let err = s["last_error"].as_str().unwrap_or_default().to_owned();
        ensure!(
            err.contains(&format!("transaction {failing} ")),
            "the error does not name transaction {failing}: {err}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
        let before = self
            .value(1, "SELECT count(*) FROM items WHERE id < 25")
            .await?;
        let after = self
            .value(1, "SELECT count(*) FROM items WHERE id >= 25")
            .await?;
        ensure!(
            before == 24 && after == 0,
            "{before} of the 24 transactions before the failed one applied, {after} from it on"
        );
        self.pg[1]
            .execute("ALTER TABLE items DROP CONSTRAINT not_25")
            .await?;
        self.wait_for(
            1,
            "SELECT count(*) FROM items",
            "50",
            Duration::from_secs(60),
        )
        .await?;
        self.wait_sync(60).await?;
        self.assert_same("SELECT id, v FROM items ORDER BY id")
            .await?;
        Ok(())
    }

    /// The rows of `sql` on every node; fails (showing both) unless all equal.
    pub async fn assert_same(&self, sql: &str) -> Result<Rows> {
        let first = self.rows(0, sql).await?;
        for i in 1..self.pg.len() {
            let other = self.rows(i, sql).await?;
            if other != first {
                bail!(
                    "{sql}: node {} and node {} differ\n{}: {} rows {:?}\n{}: {} rows {:?}",
                    self.pg[0].name(),
                    self.pg[i].name(),
                    self.pg[0].name(),
                    first.len(),
                    first.iter().take(10).collect::<Vec<_>>(),
                    self.pg[i].name(),
                    other.len(),
                    other.iter().take(10).collect::<Vec<_>>()
                );
            }
        }
        Ok(first)
    }

    /// Polls until `sql` returns `want` (as text) on node `i`.
    pub async fn wait_for(&self, i: usize, sql: &str, want: &str, timeout: Duration) -> Result<()> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let rows = self.pg[i].query_strings(sql).await?;
            let got = rows.first().and_then(|r| r.first().cloned()).flatten();
            if got.as_deref() == Some(want) {
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                bail!(
                    "{sql} on {}: got {got:?}, want {want:?} after {timeout:?}",
                    self.pg[i].name()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The status entry of the stream `from` -> `to` from the aggregate
    /// `mmctl status --json` (any object carrying those two names).
    pub async fn stream_status(&self, from: &str, to: &str) -> Result<serde_json::Value> {
        let v = self.status_json(0).await?;
        let mut stack = vec![&v];
        while let Some(x) = stack.pop() {
            match x {
                serde_json::Value::Object(m) => {
                    if m.get("from").and_then(|v| v.as_str()) == Some(from)
                        && m.get("to").and_then(|v| v.as_str()) == Some(to)
                        && m.contains_key("state")
                    {
                        return Ok(x.clone());
                    }
                    stack.extend(m.values());
                }
                serde_json::Value::Array(a) => stack.extend(a.iter()),
                _ => {}
            }
        }
        bail!("no stream {from} -> {to} in status: {v}")
    }

    /// The index of the node called `name`.
    pub fn index_of(&self, name: &str) -> Result<usize> {
        self.agents
            .iter()
            .position(|a| a.name == name)
            .with_context(|| format!("no node {name} in the cluster"))
    }

    /// `mmctl pause --from F --to T` through agent `via`; mmctl returns once
    /// the stream is actually paused.
    pub async fn pause_via(&self, via: usize, from: &str, to: &str) -> Result<()> {
        self.mmctl(via, &["pause", "--from", from, "--to", to])
            .await?
            .ok()
            .with_context(|| format!("pause {from} -> {to}"))?;
        Ok(())
    }

    /// `mmctl resume --from F --to T` through agent `via`.
    pub async fn resume_via(&self, via: usize, from: &str, to: &str) -> Result<()> {
        self.mmctl(via, &["resume", "--from", from, "--to", to])
            .await?
            .ok()
            .with_context(|| format!("resume {from} -> {to}"))?;
        Ok(())
    }

    /// `pause_via` agent 0.
    pub async fn pause(&self, from: &str, to: &str) -> Result<()> {
        self.pause_via(0, from, to).await
    }

    /// `resume_via` agent 0.
    pub async fn resume(&self, from: &str, to: &str) -> Result<()> {
        self.resume_via(0, from, to).await
    }

    /// Waits until the stream `from` -> `to` is in `state` (e.g. "error")
    /// and, when given, its `last_error` contains every one of `needles`.
    /// Returns the stream's status object.
    pub async fn wait_stream(
        &self,
        from: &str,
        to: &str,
        state: &str,
        needles: &[&str],
        timeout: Duration,
    ) -> Result<serde_json::Value> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let s = self.stream_status(from, to).await?;
            let err = s.get("last_error").and_then(|e| e.as_str()).unwrap_or("");
            if s.get("state").and_then(|v| v.as_str()) == Some(state)
                && needles.iter().all(|n| err.contains(n))
            {
                return Ok(s);
            }
            if std::time::Instant::now() > deadline {
                bail!(
                    "stream {from} -> {to} never reached state {state:?} with an error containing {needles:?} within {timeout:?}; last status: {s}"
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// `mmctl status --json` from agent `i`.
    /// Also when it exits 1 because a stream is in error: the JSON is
    /// printed all the same.
    pub async fn status_json(&self, i: usize) -> Result<serde_json::Value> {
        let out = self.mmctl(i, &["status", "--json"]).await?;
        match out.json() {
            Ok(v) => Ok(v),
            Err(_) => out.ok()?.json(),
        }
    }
}
