//! A whole test cluster: PostgreSQL nodes, one agent each, formed with mmctl.

use std::io::Read;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};

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
