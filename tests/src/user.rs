//! Who PostgreSQL runs as. The server refuses to start as root, and CI runs
//! the suite as root, so every PostgreSQL program is then started as the
//! unprivileged user [`TEST_USER`]; otherwise everything runs as ourselves.

use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;

use anyhow::{Context, Result, bail};

/// The unprivileged account servers run as when the tests run as root.
pub const TEST_USER: &str = "mmtest";

/// The identity PostgreSQL programs run as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunAs {
    /// We are not root: run as ourselves.
    Current,
    /// We are root: drop to this uid/gid in the child.
    User { uid: u32, gid: u32 },
}

impl RunAs {
    /// The identity for this process, creating [`TEST_USER`] if we are root
    /// and it is missing. Cached for the life of the process.
    pub fn get() -> Result<RunAs> {
        static CACHE: OnceLock<Result<RunAs, String>> = OnceLock::new();
        CACHE
            .get_or_init(|| detect().map_err(|e| format!("{e:#}")))
            .clone()
            .map_err(anyhow::Error::msg)
    }

    /// A command for `program` that runs as this identity. Uses std's
    /// setuid/setgid in the child (which also clears supplementary groups),
    /// so no `su`/`runuser` is needed.
    pub fn command(self, program: impl AsRef<Path>) -> Command {
        let mut cmd = Command::new(program.as_ref());
        if let RunAs::User { uid, gid } = self {
            use std::os::unix::process::CommandExt;
            cmd.uid(uid).gid(gid);
        }
        cmd
    }

    /// Gives `path` to this identity (no-op when running as ourselves).
    pub fn chown(self, path: &Path) -> Result<()> {
        if let RunAs::User { uid, gid } = self {
            std::os::unix::fs::chown(path, Some(uid), Some(gid))
                .with_context(|| format!("chown {} to {TEST_USER}", path.display()))?;
        }
        Ok(())
    }

    /// The numeric uid, for keying caches by identity.
    pub fn uid(self) -> u32 {
        match self {
            RunAs::Current => effective_uid().unwrap_or(u32::MAX),
            RunAs::User { uid, .. } => uid,
        }
    }
}

/// The effective uid of this process, from /proc (no unsafe libc call).
pub fn effective_uid() -> Result<u32> {
    proc_status_uid("self").context("reading /proc/self/status")
}

/// The effective uid of process `pid` (e.g. to check the postmaster's owner).
pub fn process_uid(pid: u32) -> Result<u32> {
    proc_status_uid(&pid.to_string()).with_context(|| format!("reading /proc/{pid}/status"))
}

fn proc_status_uid(pid: &str) -> Result<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    // "Uid:\treal\teffective\tsaved\tfs"
    let line = status
        .lines()
        .find(|l| l.starts_with("Uid:"))
        .context("no Uid: line")?;
    let euid = line.split_whitespace().nth(2).context("short Uid: line")?;
    Ok(euid.parse()?)
}

fn detect() -> Result<RunAs> {
    if effective_uid()? != 0 {
        return Ok(RunAs::Current);
    }
    ensure_user()?;
    Ok(RunAs::User {
        uid: id_of("-u")?,
        gid: id_of("-g")?,
    })
}

/// Creates [`TEST_USER`]. Parallel test processes may race here: a failing
/// `useradd` is fine as long as the user exists afterwards.
fn ensure_user() -> Result<()> {
    for attempt in 0..20 {
        if id_of("-u").is_ok() {
            return Ok(());
        }
        let out = Command::new("useradd")
            .args(["-m", "-s", "/bin/sh", TEST_USER])
            .output()
            .context("running useradd (needed to run PostgreSQL as non-root)")?;
        if out.status.success() || id_of("-u").is_ok() {
            return Ok(());
        }
        // Exit 10: /etc/passwd is locked by a concurrent useradd.
        if attempt == 19 {
            bail!(
                "useradd {TEST_USER} failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    Ok(())
}

fn id_of(flag: &str) -> Result<u32> {
    let out = Command::new("id")
        .args([flag, TEST_USER])
        .output()
        .context("running id")?;
    if !out.status.success() {
        bail!("user {TEST_USER} does not exist");
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
}
