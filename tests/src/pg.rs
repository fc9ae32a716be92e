//! A real PostgreSQL server per test node.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tokio_postgres::{Client, NoTls, SimpleQueryMessage};

use crate::install::{HARNESS_CONF, pg_bin_dir, template_dir};
use crate::ports::free_port;
use crate::procs::{ProcId, pid_alive};
use crate::sweep::{OWNER_FILE, kill_node, postmaster_pid, run_root, sweep_once};
use crate::user::RunAs;

/// How many fresh ports to try when another process grabbed ours between
/// `free_port()` and the server binding it.
const PORT_ATTEMPTS: usize = 8;
/// Lines of server log printed when a test panics while the node is alive.
const PANIC_LOG_LINES: usize = 60;
const LOG_FILE: &str = "postgres.log";

/// How clients authenticate over TCP. Unix-socket connections are always
/// trusted (the harness uses them to set the password).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Auth {
    #[default]
    Trust,
    /// md5 with this password for the `postgres` superuser.
    Md5(String),
    /// scram-sha-256 with this password for the `postgres` superuser.
    Scram(String),
}

impl Auth {
    fn password(&self) -> Option<&str> {
        match self {
            Auth::Trust => None,
            Auth::Md5(p) | Auth::Scram(p) => Some(p),
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct PgOptions {
    /// Extra `postgresql.conf` settings, applied after (and so overriding)
    /// the harness's own.
    pub extra_conf: Vec<(String, String)>,
    pub auth: Auth,
}

impl PgOptions {
    /// Adds one `postgresql.conf` setting.
    pub fn conf(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.extra_conf.push((key.into(), value.into()));
        self
    }

    pub fn auth(mut self, auth: Auth) -> Self {
        self.auth = auth;
        self
    }
}

/// A running PostgreSQL server on 127.0.0.1, owned by the test: dropping it
/// stops the server and deletes its directory.
pub struct PgNode {
    name: String,
    dir: PathBuf,
    data: PathBuf,
    bin: PathBuf,
    port: u16,
    options: PgOptions,
    run_as: RunAs,
    /// Connection reused by `execute`/`query_strings`; taken out while in use
    /// so no lock is held across an await.
    cached: Mutex<Option<Client>>,
}

impl std::fmt::Debug for PgNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgNode")
            .field("name", &self.name)
            .field("port", &self.port)
            .field("dir", &self.dir)
            .finish()
    }
}

impl PgNode {
    /// Starts a node with default options (trust authentication).
    pub fn start(name: &str) -> Result<PgNode> {
        Self::start_with(name, PgOptions::default())
    }

    /// Starts a node: copies the template data dir, writes the settings and
    /// starts the server, retrying with another port if ours was taken.
    pub fn start_with(name: &str, options: PgOptions) -> Result<PgNode> {
        // The name ends up in the unix socket path, which must stay under
        // ~107 bytes.
        if name.is_empty()
            || name.len() > 40
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            bail!("node name {name:?} must be 1-40 characters from [A-Za-z0-9_-]");
        }
        let bin = pg_bin_dir()?;
        let run_as = RunAs::get()?;
        sweep_once(&bin, run_as);
        let template = template_dir(&bin, run_as)?;
        let dir = create_node_dir(name, run_as)?;

        // From here on, Drop cleans up whatever fails.
        let mut node = PgNode {
            name: name.to_owned(),
            data: dir.join("data"),
            dir,
            bin,
            port: 0,
            options,
            run_as,
            cached: Mutex::new(None),
        };
        node.copy_template(&template)?;
        node.write_hba()?;
        node.boot()?;
        node.set_password()?;
        Ok(node)
    }

    fn copy_template(&self, template: &Path) -> Result<()> {
        let out = self
            .run_as
            .command("cp")
            .arg("-a")
            .arg(template)
            .arg(&self.data)
            .output()
            .context("running cp")?;
        check(&out, "cp -a template")
    }

    /// Tries ports until the server starts.
    fn boot(&mut self) -> Result<()> {
        for attempt in 1..=PORT_ATTEMPTS {
            self.port = free_port();
            self.write_conf()?;
            let log_start = self.log_len();
            match self.pg_ctl_start() {
                Ok(()) => return Ok(()),
                Err(e) => {
                    let log = self.log_since(log_start);
                    let port_taken = log.contains("Address already in use")
                        || log.contains("could not create any TCP/IP sockets");
                    if !port_taken || attempt == PORT_ATTEMPTS {
                        return Err(e.context(format!(
                            "starting PostgreSQL node {} on port {}; server log:\n{log}",
                            self.name, self.port
                        )));
                    }
                    tracing::debug!(node = %self.name, port = self.port, "port taken, retrying");
                }
            }
        }
        bail!("unreachable: no start attempt made")
    }

    fn write_conf(&self) -> Result<()> {
        let dir = self.dir.display().to_string();
        let mut settings: Vec<(&str, String)> = vec![
            ("listen_addresses", "127.0.0.1".into()),
            ("port", self.port.to_string()),
            ("unix_socket_directories", dir),
            ("wal_level", "logical".into()),
            ("track_commit_timestamp", "on".into()),
            ("max_replication_slots", "20".into()),
            ("max_wal_senders", "20".into()),
            // Apply lanes bind an origin each (`replication.apply_lanes`).
            ("max_active_replication_origins", "64".into()),
            ("max_worker_processes", "20".into()),
            // Many nodes share a small machine.
            ("max_connections", "60".into()),
            ("shared_buffers", "32MB".into()),
            // fsync and synchronous_commit stay at their (durable) defaults:
            // crash tests kill servers and expect committed data to survive.
            // Crash recovery first fsyncs the data dir; one syncfs() instead
            // of an fsync per file cuts a restart after a crash from ~3 s to
            // well under one, with the same durability.
            ("recovery_init_sync_method", "syncfs".into()),
            ("logging_collector", "off".into()),
            ("log_min_messages", "warning".into()),
            ("log_line_prefix", "%m [%p] %q%a ".into()),
            ("log_timezone", "UTC".into()),
            ("timezone", "UTC".into()),
        ];
        match &self.options.auth {
            Auth::Trust => {}
            Auth::Md5(_) => settings.push(("password_encryption", "md5".into())),
            Auth::Scram(_) => settings.push(("password_encryption", "scram-sha-256".into())),
        }
        let mut text = String::from("# written by the mm test harness; do not edit\n");
        for (k, v) in settings.iter().map(|(k, v)| (*k, v.as_str())).chain(
            self.options
                .extra_conf
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str())),
        ) {
            text.push_str(&format!("{k} = '{}'\n", v.replace('\'', "''")));
        }
        let path = self.data.join(HARNESS_CONF);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        self.run_as.chown(&path)
    }

    fn write_hba(&self) -> Result<()> {
        let method = match &self.options.auth {
            Auth::Trust => return Ok(()),
            Auth::Md5(_) => "md5",
            Auth::Scram(_) => "scram-sha-256",
        };
        let text = format!(
            "# written by the mm test harness\n\
             local all all trust\n\
             local replication all trust\n\
             host all all 127.0.0.1/32 {method}\n\
             host replication all 127.0.0.1/32 {method}\n"
        );
        let path = self.data.join("pg_hba.conf");
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        self.run_as.chown(&path)
    }

    /// Sets the superuser password over the (trusted) unix socket.
    fn set_password(&self) -> Result<()> {
        let Some(password) = self.options.auth.password() else {
            return Ok(());
        };
        let sql = format!(
            "ALTER ROLE postgres PASSWORD '{}'",
            password.replace('\'', "''")
        );
        let out = self
            .run_as
            .command(self.bin.join("psql"))
            .arg("-h")
            .arg(&self.dir)
            .args(["-p", &self.port.to_string()])
            .args(["-U", "postgres", "-d", "postgres", "-X", "-q"])
            .args(["-v", "ON_ERROR_STOP=1", "-c", &sql])
            .output()
            .context("running psql")?;
        check(&out, "setting the superuser password")
    }

    fn pg_ctl_start(&self) -> Result<()> {
        let out = self
            .run_as
            .command(self.bin.join("pg_ctl"))
            .arg("start")
            .arg("-D")
            .arg(&self.data)
            .arg("-l")
            .arg(self.log_path())
            .args(["-w", "-t", "60", "-s"])
            .current_dir(&self.dir)
            .output()
            .context("running pg_ctl start")?;
        check(&out, "pg_ctl start")
    }

    fn pg_ctl_stop(&self, mode: &str) -> Result<()> {
        self.drop_cached();
        let out = self
            .run_as
            .command(self.bin.join("pg_ctl"))
            .arg("stop")
            .arg("-D")
            .arg(&self.data)
            .args(["-m", mode, "-w", "-t", "60", "-s"])
            .output()
            .context("running pg_ctl stop")?;
        check(&out, &format!("pg_ctl stop -m {mode} (node {})", self.name))
    }

    /// Clean shutdown (`pg_ctl stop -m fast`).
    pub fn stop(&self) -> Result<()> {
        self.pg_ctl_stop("fast")
    }

    /// Crash-like shutdown (`pg_ctl stop -m immediate`): no checkpoint, the
    /// next start runs crash recovery.
    pub fn stop_immediate(&self) -> Result<()> {
        self.pg_ctl_stop("immediate")
    }

    /// SIGKILLs the postmaster, like a crash of the server process, and waits
    /// until it is gone. Its backends exit on their own shortly after.
    pub fn kill9(&self) -> Result<()> {
        self.drop_cached();
        let pid = self
            .pid()
            .with_context(|| format!("node {} is not running", self.name))?;
        let out = std::process::Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .output()
            .context("running kill")?;
        check(&out, "kill -KILL postmaster")?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while pid_alive(pid) {
            if Instant::now() > deadline {
                bail!(
                    "postmaster {pid} of node {} survived SIGKILL for 10 s",
                    self.name
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Starts the server again on the same port after `stop*` or `kill9`.
    /// Retries for a while: after a kill the old backends may still hold the
    /// shared memory, which makes the new postmaster refuse to start.
    pub fn start_again(&self) -> Result<()> {
        if let Some(pid) = self.pid() {
            bail!("node {} is already running (postmaster {pid})", self.name);
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            self.clear_stale_locks();
            let log_start = self.log_len();
            match self.pg_ctl_start() {
                Ok(()) => return Ok(()),
                Err(e) if Instant::now() > deadline => {
                    return Err(e.context(format!(
                        "restarting node {}; server log:\n{}",
                        self.name,
                        self.log_since(log_start)
                    )));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }

    /// Removes lock files of a postmaster that is dead but not yet reaped.
    ///
    /// PostgreSQL treats a lock file as live while its pid exists, and a
    /// zombie exists until its parent reaps it. Servers started by pg_ctl are
    /// reparented to PID 1, and minimal container inits reap lazily, so after
    /// `kill9` a restart could be refused for seconds. On a real host the
    /// crashed postmaster is reaped at once; removing the files restores that.
    fn clear_stale_locks(&self) {
        let socket_lock = self.dir.join(format!(".s.PGSQL.{}.lock", self.port));
        for lock in [self.data.join("postmaster.pid"), socket_lock] {
            let pid = std::fs::read_to_string(&lock)
                .ok()
                .and_then(|t| t.lines().next()?.trim().parse::<u32>().ok());
            if let Some(pid) = pid
                && !pid_alive(pid)
            {
                let _ = std::fs::remove_file(&lock);
            }
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn host(&self) -> &'static str {
        "127.0.0.1"
    }

    /// libpq key=value DSN for database `postgres` as superuser `postgres`.
    /// Never contains the password (see [`PgNode::password`]).
    pub fn dsn(&self) -> String {
        self.dsn_for("postgres")
    }

    /// The DSN an agent beside this server uses (`postgres.dsn`): the unix
    /// socket, as SPEC's example and the Ansible role deploy it. Over
    /// loopback TCP the apply backend spends about a third of its CPU in
    /// send() for single-row transactions (ARCHITECTURE, "Apply throughput").
    pub fn local_dsn(&self) -> String {
        format!(
            "host={} port={} user=postgres dbname=postgres",
            self.socket_dir().display(),
            self.port
        )
    }

    pub fn dsn_for(&self, db: &str) -> String {
        format!(
            "host={} port={} user=postgres dbname={db}",
            self.host(),
            self.port
        )
    }

    /// The superuser password, when the node was started with md5/scram.
    pub fn password(&self) -> Option<&str> {
        self.options.auth.password()
    }

    /// The node directory: holds `data/`, the server log, the unix socket.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn data_dir(&self) -> &Path {
        &self.data
    }

    pub fn socket_dir(&self) -> &Path {
        &self.dir
    }

    pub fn bin_dir(&self) -> &Path {
        &self.bin
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.join(LOG_FILE)
    }

    /// The postmaster's pid while the server runs.
    pub fn pid(&self) -> Option<u32> {
        postmaster_pid(&self.data).filter(|p| pid_alive(*p))
    }

    /// The last `lines` lines of the server log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read(self.log_path())
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    fn log_len(&self) -> u64 {
        std::fs::metadata(self.log_path()).map_or(0, |m| m.len())
    }

    fn log_since(&self, offset: u64) -> String {
        let bytes = std::fs::read(self.log_path()).unwrap_or_default();
        let start = usize::try_from(offset).unwrap_or(0).min(bytes.len());
        String::from_utf8_lossy(&bytes[start..]).into_owned()
    }

    /// A new connection to database `postgres` (the connection task is
    /// spawned on the current tokio runtime).
    pub async fn connect(&self) -> Result<Client> {
        self.connect_db("postgres").await
    }

    pub async fn connect_db(&self, db: &str) -> Result<Client> {
        let mut config: tokio_postgres::Config = self.dsn_for(db).parse()?;
        if let Some(pw) = self.password() {
            config.password(pw);
        }
        let (client, conn) = config
            .connect(NoTls)
            .await
            .with_context(|| format!("connecting to node {} ({})", self.name, self.dsn_for(db)))?;
        let name = self.name.clone();
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                // Expected when tests stop or kill the server.
                tracing::debug!(node = %name, error = %e, "connection ended");
            }
        });
        Ok(client)
    }

    /// Runs SQL (one or more statements, simple protocol).
    pub async fn execute(&self, sql: &str) -> Result<()> {
        let client = self.take_cached().await?;
        match client.batch_execute(sql).await {
            Ok(()) => {
                self.put_cached(client);
                Ok(())
            }
            // The session may be left inside an aborted transaction: discard it.
            Err(e) => {
                Err(e).with_context(|| format!("node {}: executing {}", self.name, brief(sql)))
            }
        }
    }

    /// Runs SQL with the simple protocol and returns every row's values as
    /// text (NULL as `None`): the form in which rows from different nodes
    /// compare equal exactly when their contents do.
    pub async fn query_strings(&self, sql: &str) -> Result<Vec<Vec<Option<String>>>> {
        let client = self.take_cached().await?;
        let messages = match client.simple_query(sql).await {
            Ok(m) => m,
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("node {}: querying {}", self.name, brief(sql)));
            }
        };
        self.put_cached(client);
        Ok(messages
            .iter()
            .filter_map(|m| match m {
                SimpleQueryMessage::Row(row) => Some(
                    (0..row.len())
                        .map(|i| row.get(i).map(str::to_owned))
                        .collect(),
                ),
                _ => None,
            })
            .collect())
    }

    /// The single value of a one-row, one-column query.
    pub async fn query_one_string(&self, sql: &str) -> Result<Option<String>> {
        let rows = self.query_strings(sql).await?;
        match rows.as_slice() {
            [row] if row.len() == 1 => Ok(row[0].clone()),
            _ => bail!(
                "node {}: expected one row with one column from {}, got {rows:?}",
                self.name,
                brief(sql)
            ),
        }
    }

    /// Waits until one of the agent's sessions here waits for a lock (a
    /// test's transaction holds it, to stop an apply statement at a chosen
    /// point); `what` names that statement in the timeout's error.
    pub async fn wait_for_agent_lock_wait(&self, timeout: Duration, what: &str) -> Result<()> {
        let waiting = "SELECT count(*) FROM pg_stat_activity \
                       WHERE application_name = 'mm-agent' AND wait_event_type = 'Lock'";
        let deadline = Instant::now() + timeout;
        while self.query_one_string(waiting).await?.as_deref() != Some("1") {
            if Instant::now() >= deadline {
                bail!("node {}: {what} never waited for the lock", self.name);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    async fn take_cached(&self) -> Result<Client> {
        let cached = self.cached.lock().unwrap_or_else(|p| p.into_inner()).take();
        match cached {
            Some(c) if !c.is_closed() => Ok(c),
            _ => self.connect().await,
        }
    }

    fn put_cached(&self, client: Client) {
        *self.cached.lock().unwrap_or_else(|p| p.into_inner()) = Some(client);
    }

    fn drop_cached(&self) {
        self.cached.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}

impl Drop for PgNode {
    fn drop(&mut self) {
        let panicking = std::thread::panicking();
        if panicking {
            eprintln!(
                "---- last {PANIC_LOG_LINES} lines of node {} server log ({}) ----\n{}\n---- end of log ----",
                self.name,
                self.log_path().display(),
                self.log_tail(PANIC_LOG_LINES)
            );
        }
        self.drop_cached();
        kill_node(&self.bin, self.run_as, &self.dir);
        if panicking && std::env::var("MM_KEEP_TEST_DIRS").is_ok_and(|v| v == "1") {
            eprintln!("MM_KEEP_TEST_DIRS=1: keeping {}", self.dir.display());
            return;
        }
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            eprintln!("cannot remove {}: {e}", self.dir.display());
        }
        // Succeeds only when this was the process's last node.
        let _ = std::fs::remove_dir(run_root());
    }
}

/// Creates `<run root>/<name>` (or `<name>-2`, ... if a node of that name
/// exists in this process), owned by the run-as user, with the owner file.
fn create_node_dir(name: &str, run_as: RunAs) -> Result<PathBuf> {
    let root = run_root();
    let mut suffix = 1;
    for _ in 0..1000 {
        std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
        let dir = if suffix == 1 {
            root.join(name)
        } else {
            root.join(format!("{name}-{suffix}"))
        };
        match std::fs::create_dir(&dir) {
            Ok(()) => {
                if let Some(me) = ProcId::current() {
                    std::fs::write(dir.join(OWNER_FILE), me.encode())
                        .with_context(|| format!("writing owner file in {}", dir.display()))?;
                }
                run_as.chown(&dir)?;
                return Ok(dir);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => suffix += 1,
            // The run root was removed by a concurrent Drop: recreate it.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("creating {}", dir.display())),
        }
    }
    bail!(
        "cannot find a free directory name for node {name} under {}",
        root.display()
    )
}

fn check(out: &Output, what: &str) -> Result<()> {
    if out.status.success() {
        return Ok(());
    }
    bail!(
        "{what} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout).trim(),
        String::from_utf8_lossy(&out.stderr).trim()
    )
}

/// The start of a statement, for error messages.
fn brief(sql: &str) -> String {
    let one_line = sql.split_whitespace().collect::<Vec<_>>().join(" ");
    if one_line.chars().count() > 120 {
        format!("{}...", one_line.chars().take(120).collect::<String>())
    } else {
        one_line
    }
}
