//! Locating the PostgreSQL binaries and the initdb'd template every node is
//! copied from.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::procs::ProcId;
use crate::repo_root;
use crate::user::RunAs;

/// Bump when the template's content changes (initdb flags, the include line),
/// so stale templates from older harness versions are not reused.
const TEMPLATE_FORMAT: u32 = 1;

/// The conf file each node writes its settings to; the template's
/// postgresql.conf includes it.
pub const HARNESS_CONF: &str = "mm-harness.conf";

/// The PostgreSQL bin directory: `MM_PG_BIN` if set, else whatever
/// `scripts/install-postgres.sh` installs (or finds) — run once per process.
pub fn pg_bin_dir() -> Result<PathBuf> {
    static CACHE: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    CACHE
        .get_or_init(|| find_bin_dir().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(anyhow::Error::msg)
}

fn find_bin_dir() -> Result<PathBuf> {
    if let Some(bin) = std::env::var_os("MM_PG_BIN").filter(|v| !v.is_empty()) {
        let bin = PathBuf::from(bin);
        if !bin.join("postgres").is_file() {
            bail!("MM_PG_BIN={} has no postgres binary", bin.display());
        }
        return Ok(bin);
    }
    let script = repo_root().join("scripts/install-postgres.sh");
    let out = Command::new("bash")
        .arg(&script)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !out.status.success() {
        bail!("{} failed ({})", script.display(), out.status);
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .with_context(|| format!("{} printed no bin dir", script.display()))?;
    Ok(PathBuf::from(last.trim()))
}

/// A freshly initdb'd data directory for this PostgreSQL build and run-as
/// identity, created once per machine and reused by every node (copying it
/// takes a fraction of initdb's time).
///
/// Invariant: the template path only ever holds a complete data directory —
/// initdb writes to a private temporary directory that is renamed into place,
/// which is atomic, so concurrent test processes either see nothing or a
/// finished template. The lock file only saves duplicate initdb work.
pub fn template_dir(bin: &Path, run_as: RunAs) -> Result<PathBuf> {
    static CACHE: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    CACHE
        .get_or_init(|| ensure_template(bin, run_as).map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(anyhow::Error::msg)
}

fn ensure_template(bin: &Path, run_as: RunAs) -> Result<PathBuf> {
    let version = postgres_version(bin)?;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    TEMPLATE_FORMAT.hash(&mut h);
    bin.canonicalize()
        .unwrap_or_else(|_| bin.to_owned())
        .hash(&mut h);
    version.hash(&mut h);
    if let Ok(meta) = std::fs::metadata(bin.join("postgres")) {
        meta.len().hash(&mut h);
        meta.modified().ok().hash(&mut h);
    }
    run_as.uid().hash(&mut h);
    let base = PathBuf::from(format!("/var/tmp/mm-pg-template-{:016x}", h.finish()));
    if base.join("PG_VERSION").is_file() {
        return Ok(base);
    }

    let lock = base.with_extension("lock");
    let holding_lock = acquire_lock(&lock, &base)?;
    if base.join("PG_VERSION").is_file() {
        release_lock(holding_lock, &lock);
        return Ok(base);
    }
    let result = build_template(bin, run_as, &base);
    release_lock(holding_lock, &lock);
    result.map(|()| base)
}

/// Waits while a live process holds `lock` and the template is not there.
/// Returns whether we hold the lock (false: we gave up waiting and build a
/// template anyway, relying on the atomic rename).
fn acquire_lock(lock: &Path, template: &Path) -> Result<bool> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(lock)
        {
            Ok(mut f) => {
                use std::io::Write;
                if let Some(me) = ProcId::current() {
                    // Best effort: an empty lock file is treated as stale.
                    let _ = f.write_all(me.encode().as_bytes());
                }
                return Ok(true);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e).with_context(|| format!("creating {}", lock.display())),
        }
        if template.join("PG_VERSION").is_file() {
            return Ok(false);
        }
        let holder = std::fs::read_to_string(lock)
            .ok()
            .and_then(|s| ProcId::decode(&s));
        let stale = holder.is_none_or(|p| !p.is_alive());
        if stale {
            // Give a just-created lock a moment to get its content.
            std::thread::sleep(Duration::from_millis(200));
            let again = std::fs::read_to_string(lock)
                .ok()
                .and_then(|s| ProcId::decode(&s));
            if again.is_none_or(|p| !p.is_alive()) {
                let _ = std::fs::remove_file(lock);
            }
            continue;
        }
        if Instant::now() > deadline {
            return Ok(false);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn release_lock(held: bool, lock: &Path) {
    if held {
        let _ = std::fs::remove_file(lock);
    }
}

fn build_template(bin: &Path, run_as: RunAs, template: &Path) -> Result<()> {
    let tmp = PathBuf::from(format!("{}.tmp-{}", template.display(), std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let started = Instant::now();
    // --no-sync: the template is scratch; the servers fsync their own writes.
    let out = run_as
        .command(bin.join("initdb"))
        .arg("-D")
        .arg(&tmp)
        .args([
            "-U",
            "postgres",
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
            "--no-instructions",
        ])
        .env("LC_ALL", "C")
        .current_dir("/")
        .output()
        .context("running initdb")?;
    if !out.status.success() {
        let _ = std::fs::remove_dir_all(&tmp);
        bail!(
            "initdb failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let conf = tmp.join("postgresql.conf");
    let mut text =
        std::fs::read_to_string(&conf).with_context(|| format!("reading {}", conf.display()))?;
    text.push_str(&format!("\n# per-node settings written by the mm test harness\ninclude_if_exists = '{HARNESS_CONF}'\n"));
    std::fs::write(&conf, text).with_context(|| format!("writing {}", conf.display()))?;
    match std::fs::rename(&tmp, template) {
        Ok(()) => {}
        // Lost a race with another process: its template is as good as ours.
        Err(_) if template.join("PG_VERSION").is_file() => {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e)
                .with_context(|| format!("renaming template into {}", template.display()));
        }
    }
    tracing::info!(template = %template.display(), elapsed = ?started.elapsed(), "created PostgreSQL template");
    Ok(())
}

/// `postgres --version` output, e.g. "postgres (PostgreSQL) 18.6".
pub fn postgres_version(bin: &Path) -> Result<String> {
    let out = Command::new(bin.join("postgres"))
        .arg("--version")
        .output()
        .with_context(|| format!("running {}/postgres --version", bin.display()))?;
    if !out.status.success() {
        bail!("{}/postgres --version failed", bin.display());
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}
