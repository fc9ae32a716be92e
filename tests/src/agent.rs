//! Real `mm-agent` processes beside harness PostgreSQL nodes, and `mmctl`.
//!
//! Binaries come from the workspace's target dir (the profile this test was
//! built with) unless `MM_AGENT_BIN` / `MMCTL_BIN` point elsewhere;
//! `scripts/test.sh` builds them before the suites run.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::procs::ProcId;
use crate::{PgNode, free_port};

const AGENT_ROOT_PREFIX: &str = "mm-agents-";

fn bin(name: &str, env: &str) -> Result<PathBuf> {
    if let Ok(p) = std::env::var(env) {
        return Ok(PathBuf::from(p));
    }
    // current_exe = <target>/<profile>/deps/<test>-<hash>
    let exe = std::env::current_exe().context("locating the test executable")?;
    let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let p = dir.join(name);
    if !p.exists() {
        bail!(
            "{} not found: build it first (cargo build --workspace --bins) or set {env}",
            p.display()
        );
    }
    Ok(p)
}

pub fn agent_bin() -> Result<PathBuf> {
    bin("mm-agent", "MM_AGENT_BIN")
}

pub fn mmctl_bin() -> Result<PathBuf> {
    bin("mmctl", "MMCTL_BIN")
}

/// Another binary of the target dir (e.g. `mm-agent-custom`, an agent that
/// embeds the daemon with extra resolvers), or `$env` when set.
pub fn target_bin(name: &str, env: &str) -> Result<PathBuf> {
    bin(name, env)
}

/// Kills agents left running by test processes that died before their Drop.
fn sweep_agents() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let Ok(entries) = std::fs::read_dir("/var/tmp") else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            if !name.to_string_lossy().starts_with(AGENT_ROOT_PREFIX) {
                continue;
            }
            let Ok(agents) = std::fs::read_dir(e.path()) else {
                continue;
            };
            let mut all_dead = true;
            for a in agents.flatten() {
                let owner = std::fs::read_to_string(a.path().join("owner"))
                    .ok()
                    .and_then(|s| ProcId::decode(&s));
                if owner.is_some_and(|o| o.is_alive()) {
                    all_dead = false;
                    continue;
                }
                if let Some(pid) = std::fs::read_to_string(a.path().join("agent.pid"))
                    .ok()
                    .and_then(|s| ProcId::decode(&s))
                    .filter(|p| p.is_alive())
                {
                    let _ = Command::new("kill")
                        .arg("-9")
                        .arg(pid.pid.to_string())
                        .status();
                }
            }
            if all_dead {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    });
}

/// One agent process. Dropping it kills the process and removes its dir.
pub struct AgentProcess {
    pub name: String,
    pub port: u16,
    dir: PathBuf,
    config: PathBuf,
    child: Option<Child>,
    /// Extra environment for the agent (e.g. MM_LOG).
    env: Vec<(String, String)>,
    /// The agent binary, when not the default `mm-agent` (see `agent_bin`).
    bin: Option<PathBuf>,
    /// It listened once: its URL may be known to others, its port is fixed.
    listened: bool,
}

/// The shared secrets of a test cluster.
pub struct Secrets {
    pub token_file: PathBuf,
}

impl AgentProcess {
    /// Writes a config for an agent beside `pg` and starts it.
    pub fn spawn(name: &str, pg: &PgNode, secrets: &Secrets) -> Result<AgentProcess> {
        Self::spawn_with(name, pg, secrets, &[], "")
    }

    /// Like `spawn`, with extra environment and extra TOML appended to the config.
    pub fn spawn_with(
        name: &str,
        pg: &PgNode,
        secrets: &Secrets,
        env: &[(&str, &str)],
        extra_toml: &str,
    ) -> Result<AgentProcess> {
        Self::spawn_bin(name, pg, secrets, env, extra_toml, None)
    }

    /// Like `spawn_with`, running `bin` instead of the default agent binary
    /// (`None`: the default).
    pub fn spawn_bin(
        name: &str,
        pg: &PgNode,
        secrets: &Secrets,
        env: &[(&str, &str)],
        extra_toml: &str,
        bin: Option<PathBuf>,
    ) -> Result<AgentProcess> {
        sweep_agents();
        let root =
            PathBuf::from("/var/tmp").join(format!("{AGENT_ROOT_PREFIX}{}", std::process::id()));
        let dir = root.join(name);
        if dir.exists() {
            std::fs::remove_dir_all(&dir)?;
        }
        std::fs::create_dir_all(dir.join("data"))?;
        if let Some(me) = ProcId::current() {
            std::fs::write(dir.join("owner"), me.encode())?;
        }
        let port = free_port();
        let config = dir.join("agent.toml");
        let dsn = pg.local_dsn();
        let peer_dsn = pg.dsn();
        let toml = format!(
            "[node]\nname = \"{name}\"\ndata_dir = \"{data}\"\n\n\
             [postgres]\ndsn = \"{dsn}\"\npeer_dsn = \"{peer_dsn}\"\n\n\
             [api]\nlisten = \"127.0.0.1:{port}\"\nadvertise = \"http://127.0.0.1:{port}\"\ntoken_file = \"{token}\"\n\n\
             [replication]\nschemas = [\"public\"]\n{extra_toml}\n",
            data = dir.join("data").display(),
            token = secrets.token_file.display(),
        );
        std::fs::write(&config, toml)?;
        let mut agent = AgentProcess {
            name: name.to_owned(),
            port,
            dir,
            config,
            child: None,
            env: env
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            bin,
            listened: false,
        };
        agent.start()?;
        Ok(agent)
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.join("agent.log")
    }

    /// Starts (again) the process with the same config and data dir.
    pub fn start(&mut self) -> Result<()> {
        if self.child.is_some() {
            bail!("agent {} is already running", self.name);
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())?;
        let bin = match &self.bin {
            Some(b) => b.clone(),
            None => agent_bin()?,
        };
        let mut cmd = Command::new(bin);
        cmd.arg("--config")
            .arg(&self.config)
            .env("MM_LOG", "info,mm_agent=debug")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().context("spawning mm-agent")?;
        std::fs::write(
            self.dir.join("agent.pid"),
            format!("{} {}\n", child.id(), proc_start(child.id()).unwrap_or(0)),
        )?;
        self.child = Some(child);
        Ok(())
    }

    /// Waits until the agent's own process listens on its API port. Not
    /// "something answers there": `free_port`'s port is free only until
    /// someone binds it, and a test once talked to another test's agent on
    /// it (HTTP 401) while its own had exited with "address in use". An
    /// agent that never listened and lost its port that way is started
    /// again on a new one.
    pub async fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(c) = self.child.as_mut()
                && let Some(st) = c.try_wait()?
            {
                self.child = None;
                let tail = self.log_tail(40);
                // Before the deadline only: the old run's line stays in
                // the log and must not restart a later failure forever.
                if !self.listened
                    && Instant::now() < deadline
                    && tail.contains("Address already in use")
                {
                    self.move_to_new_port()?;
                    self.start()?;
                    continue;
                }
                bail!("agent {} exited with {st}:\n{tail}", self.name);
            }
            if self
                .child
                .as_ref()
                .is_some_and(|c| listens(c.id(), self.port))
            {
                self.listened = true;
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "agent {} did not listen within {timeout:?}:\n{}",
                    self.name,
                    self.log_tail(40)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn move_to_new_port(&mut self) -> Result<()> {
        let port = free_port();
        let toml = std::fs::read_to_string(&self.config)?.replace(
            &format!("127.0.0.1:{}\"", self.port),
            &format!("127.0.0.1:{port}\""),
        );
        std::fs::write(&self.config, toml)?;
        self.port = port;
        Ok(())
    }

    /// Waits for the process to exit by itself (e.g. refusing to start).
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        let Some(c) = self.child.as_mut() else {
            bail!("agent {} is not running", self.name);
        };
        loop {
            if let Some(st) = c.try_wait()? {
                self.child = None;
                return Ok(st);
            }
            if Instant::now() > deadline {
                bail!("agent {} still running after {timeout:?}", self.name);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `kill -9`: the crash the exactly-once guarantee is about.
    pub fn kill9(&mut self) -> Result<()> {
        if let Some(mut c) = self.child.take() {
            c.kill()?;
            c.wait()?;
        }
        Ok(())
    }

    /// SIGTERM and wait: a clean stop.
    pub fn stop(&mut self) -> Result<()> {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(c.id().to_string())
                .status();
            let deadline = Instant::now() + Duration::from_secs(10);
            while c.try_wait()?.is_none() {
                if Instant::now() > deadline {
                    c.kill()?;
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            c.wait()?;
        }
        Ok(())
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Resident set size in bytes (from /proc), for memory-bound tests.
    pub fn rss_bytes(&self) -> Option<u64> {
        let pid = self.pid()?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    }

    /// Peak resident set size in bytes (VmHWM).
    pub fn peak_rss_bytes(&self) -> Option<u64> {
        let pid = self.pid()?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    }

    /// `GET /metrics` with the cluster token (a bare HTTP/1.1 request: the
    /// test crate needs no HTTP client for one scrape).
    pub async fn metrics(&self, token_file: &Path) -> Result<String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let token = std::fs::read_to_string(token_file)?;
        let mut sock = tokio::net::TcpStream::connect(("127.0.0.1", self.port)).await?;
        let req = format!(
            "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nAuthorization: Bearer {}\r\nConnection: close\r\n\r\n",
            self.port,
            token.trim()
        );
        sock.write_all(req.as_bytes()).await?;
        let mut buf = Vec::new();
        sock.read_to_end(&mut buf).await?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        let Some((head, body)) = text.split_once("\r\n\r\n") else {
            bail!("malformed HTTP response: {text}");
        };
        if !head.starts_with("HTTP/1.1 200") {
            bail!("GET /metrics: {head}");
        }
        if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            let mut out = String::new();
            let mut rest = body;
            while let Some((size, after)) = rest.split_once("\r\n") {
                let n = usize::from_str_radix(size.trim(), 16)?;
                if n == 0 || after.len() < n {
                    break;
                }
                out.push_str(&after[..n]);
                rest = after[n..].trim_start_matches("\r\n");
            }
            return Ok(out);
        }
        Ok(body.to_owned())
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    pub fn log_tail(&self, lines: usize) -> String {
        let log = self.log();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

fn proc_start(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "---- last lines of agent {} log ----\n{}",
                self.name,
                self.log_tail(80)
            );
        }
        let _ = self.kill9();
        if std::env::var("MM_KEEP_TEST_DIRS").as_deref() != Ok("1") {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Output of one mmctl run.
#[derive(Debug)]
pub struct MmctlOutput {
    pub status: std::process::ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl MmctlOutput {
    pub fn success(&self) -> bool {
        self.status.success()
    }

    /// Fails with both streams when mmctl did not succeed.
    pub fn ok(self) -> Result<MmctlOutput> {
        if !self.success() {
            bail!(
                "mmctl failed ({}):\nstdout: {}\nstderr: {}",
                self.status,
                self.stdout,
                self.stderr
            );
        }
        Ok(self)
    }

    pub fn json(&self) -> Result<serde_json::Value> {
        serde_json::from_str(&self.stdout)
            .with_context(|| format!("mmctl output is not JSON: {}", self.stdout))
    }
}

fn mmctl_command(
    agent_url: &str,
    token_file: &Path,
    args: &[&str],
) -> Result<tokio::process::Command> {
    let mut cmd = tokio::process::Command::new(mmctl_bin()?);
    cmd.arg("--agent")
        .arg(agent_url)
        .arg("--token-file")
        .arg(token_file)
        .args(args)
        .stdin(Stdio::null());
    Ok(cmd)
}

/// Starts `mmctl --agent <url> --token-file <f> <args>` without waiting
/// for it: for tests that kill it in the middle of a command.
pub fn mmctl_child(
    agent_url: &str,
    token_file: &Path,
    args: &[&str],
) -> Result<tokio::process::Child> {
    mmctl_command(agent_url, token_file, args)?
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .context("starting mmctl")
}

/// Runs `mmctl --agent <url> --token-file <f> <args>`.
pub async fn mmctl(agent_url: &str, token_file: &Path, args: &[&str]) -> Result<MmctlOutput> {
    let out = mmctl_command(agent_url, token_file, args)?
        .output()
        .await
        .context("running mmctl")?;
    Ok(MmctlOutput {
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

/// Whether process `pid` holds a listening TCP socket on `port` (its
/// network namespace's /proc/net/tcp, matched to its fds by inode).
fn listens(pid: u32, port: u16) -> bool {
    let Ok(tcp) = std::fs::read_to_string("/proc/net/tcp") else {
        return false;
    };
    let at = format!(":{port:04X}");
    let sockets: Vec<String> = tcp
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // local_address, st (0A = LISTEN), inode
            (f.len() > 9 && f[1].ends_with(&at) && f[3] == "0A")
                .then(|| format!("socket:[{}]", f[9]))
        })
        .collect();
    if sockets.is_empty() {
        return false;
    }
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        std::fs::read_link(fd.path())
            .ok()
            .is_some_and(|t| sockets.iter().any(|s| t.as_os_str() == s.as_str()))
    })
}
