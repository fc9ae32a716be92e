//! The mm test harness: real PostgreSQL nodes on loopback ports, for the
//! end-to-end suites and the demo.
//!
//! PostgreSQL comes from `scripts/install-postgres.sh` (or `MM_PG_BIN`);
//! when the tests run as root, servers run as the unprivileged user
//! `mmtest`. Nodes are copies of one initdb'd template, so starting one takes
//! about a second.

pub mod agent;
pub mod cluster;
mod install;
mod pg;
mod ports;
mod procs;
pub mod rng;
mod sweep;
mod user;
pub mod versions;
pub mod wal;

use std::path::PathBuf;

pub use agent::{AgentProcess, MmctlOutput, Secrets, mmctl};
pub use cluster::{Rows, TestCluster};
pub use install::{pg_bin_dir, postgres_version};
pub use pg::{Auth, PgNode, PgOptions};
pub use ports::free_port;
pub use sweep::sweep_leftovers;
pub use user::{RunAs, TEST_USER, effective_uid, process_uid};

/// The repository root (the workspace directory), fixed at compile time.
pub fn repo_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map_or(manifest.clone(), PathBuf::from)
}

/// Installs a tracing subscriber for tests: `RUST_LOG` filter (default
/// `info`), output captured per test by the test harness. Safe to call from
/// every test; only the first call in a process takes effect.
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}
