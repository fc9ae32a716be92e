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
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("MM_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cfg = match mm_cluster_config::AgentConfig::load(&args.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("mm-agent: {e}");
            return ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("mm-agent: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(mm_agent::daemon::run(cfg)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mm-agent: {e:#}");
            ExitCode::FAILURE
        }
    }
}
