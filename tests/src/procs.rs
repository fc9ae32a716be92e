//! Process liveness from /proc, used to tell our own leftovers (from a test
//! process that crashed) from directories of test processes still running.

use std::path::Path;

/// Identifies a process across pid reuse: the pid plus its start time in
/// clock ticks since boot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcId {
    pub pid: u32,
    pub start: u64,
}

impl ProcId {
    pub fn current() -> Option<ProcId> {
        let pid = std::process::id();
        Some(ProcId {
            pid,
            start: stat(pid)?.1,
        })
    }

    /// `"<pid> <start>"`, the format of owner files.
    pub fn encode(self) -> String {
        format!("{} {}\n", self.pid, self.start)
    }

    pub fn decode(s: &str) -> Option<ProcId> {
        let mut it = s.split_whitespace();
        Some(ProcId {
            pid: it.next()?.parse().ok()?,
            start: it.next()?.parse().ok()?,
        })
    }

    pub fn is_alive(self) -> bool {
        matches!(stat(self.pid), Some((state, start)) if start == self.start && !is_dead_state(state))
    }
}

/// True if `pid` exists and is not a zombie. Zombies count as dead: in
/// containers whose init does not reap, a killed postmaster stays a zombie.
pub fn pid_alive(pid: u32) -> bool {
    matches!(stat(pid), Some((state, _)) if !is_dead_state(state))
}

fn is_dead_state(state: char) -> bool {
    matches!(state, 'Z' | 'X' | 'x')
}

/// (state, start time) from /proc/<pid>/stat.
fn stat(pid: u32) -> Option<(char, u64)> {
    let text =
        std::fs::read_to_string(Path::new("/proc").join(pid.to_string()).join("stat")).ok()?;
    // The command name (field 2) is parenthesized and may contain anything,
    // so fields are counted from after its closing parenthesis.
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first()?.chars().next()?;
    // Field 22 overall (starttime) is index 19 after the name.
    let start = fields.get(19)?.parse().ok()?;
    Some((state, start))
}
