//! Per-run directories and cleanup of what crashed test processes left.
//!
//! Every node lives in `/var/tmp/mm-test-<pid>/<name>/` with an `owner` file
//! naming the test process (pid + start time). A test process killed before
//! its `Drop`s ran leaves servers running; the next process to start a node
//! stops and deletes every node whose owner is dead, so leftovers live at
//! most until the next test run.

use std::path::{Path, PathBuf};
use std::sync::Once;

use crate::procs::{ProcId, pid_alive};
use crate::user::RunAs;

const RUN_PREFIX: &str = "mm-test-";
/// Name of the file in a node dir that records the owning test process.
pub const OWNER_FILE: &str = "owner";

/// Where this process's nodes live.
pub fn run_root() -> PathBuf {
    PathBuf::from("/var/tmp").join(format!("{RUN_PREFIX}{}", std::process::id()))
}

/// Sweeps leftovers once per process.
pub fn sweep_once(bin: &Path, run_as: RunAs) {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| sweep(bin, run_as));
}

/// Stops and deletes every node whose test process is dead, now (node starts
/// do this once per process by themselves).
pub fn sweep_leftovers() -> anyhow::Result<()> {
    let bin = crate::install::pg_bin_dir()?;
    sweep(&bin, RunAs::get()?);
    Ok(())
}

fn sweep(bin: &Path, run_as: RunAs) {
    let Ok(entries) = std::fs::read_dir("/var/tmp") else {
        return;
    };
    let me = std::process::id();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(RUN_PREFIX))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        let root = entry.path();
        let Ok(nodes) = std::fs::read_dir(&root) else {
            continue;
        };
        for node in nodes.flatten() {
            let dir = node.path();
            let owner = std::fs::read_to_string(dir.join(OWNER_FILE))
                .ok()
                .and_then(|s| ProcId::decode(&s));
            let dead = match owner {
                Some(p) => !p.is_alive(),
                // Owner file not written (yet): judge by the run dir's pid.
                None => !pid_alive(pid),
            };
            if dead {
                tracing::warn!(dir = %dir.display(), "removing node left behind by a dead test process");
                kill_node(bin, run_as, &dir);
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
        // Only succeeds once empty, i.e. nothing of a live process is left.
        if !pid_alive(pid) {
            let _ = std::fs::remove_dir(&root);
        }
    }
}

/// Stops the server of a node dir, if one runs: politely via pg_ctl, then
/// by SIGKILL in case pg_ctl could not (e.g. a broken data dir).
pub fn kill_node(bin: &Path, run_as: RunAs, dir: &Path) {
    let data = dir.join("data");
    let Some(pid) = postmaster_pid(&data) else {
        return;
    };
    if !pid_alive(pid) {
        return;
    }
    let _ = run_as
        .command(bin.join("pg_ctl"))
        .arg("stop")
        .arg("-D")
        .arg(&data)
        .args(["-m", "immediate", "-w", "-t", "10", "-s"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
    if pid_alive(pid) {
        let _ = std::process::Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// The postmaster's pid from `postmaster.pid` (first line), if the file exists.
pub fn postmaster_pid(data: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(data.join("postmaster.pid")).ok()?;
    text.lines().next()?.trim().parse().ok()
}
