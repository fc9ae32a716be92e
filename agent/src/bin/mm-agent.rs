//! mm-agent: the replication sidecar that runs beside one PostgreSQL node.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "mm-agent",
    version,
    about = "mm multi-master replication agent"
)]
struct Args {
    /// The agent's TOML configuration file (keys may be overridden by MM_<SECTION>__<KEY>).
    #[arg(long, short = 'c', env = "MM_CONFIG")]
    config: PathBuf,
}

fn main() -> ExitCode {
    let args = Args::parse();
    mm_agent::daemon::main(
        "mm-agent",
        &args.config,
        mm_agent::conflict::ResolverRegistry::builtin(),
    )
}
