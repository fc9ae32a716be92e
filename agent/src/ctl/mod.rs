//! mmctl, the operator's CLI: argument parsing, dispatch, and the exit-code
//! contract (0 success; 1 failure; 2 usage) with exactly one
//! `mmctl: <what failed>: <why>` line on stderr when it fails.

pub mod client;
pub mod commands;
pub mod output;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::error::ErrorKind;
use clap::{Parser, Subcommand};

use self::client::{AgentClient, one_line, read_token};
use self::commands::{CtlError, Output};

#[derive(Debug, Parser)]
#[command(
    name = "mmctl",
    version,
    about = "Operate an mm multi-master PostgreSQL cluster"
)]
pub struct Cli {
    /// API URL of the agent to talk to.
    #[arg(
        long,
        global = true,
        env = "MM_AGENT",
        default_value = "http://127.0.0.1:7601"
    )]
    pub agent: String,
    /// File holding the cluster token.
    #[arg(
        long,
        global = true,
        env = "MM_TOKEN_FILE",
        default_value = "/etc/mm/token"
    )]
    pub token_file: PathBuf,
    /// Print machine-readable JSON instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Bootstrap a new cluster whose first member is the agent at --agent.
    Init,
    /// Join the running agent at URL (node NAME) to the cluster; returns when it is active.
    AddNode {
        #[arg(long)]
        name: String,
        #[arg(long)]
        url: String,
    },
    /// Nodes, Raft leader and term, and every stream between nodes.
    Status,
    /// Wait until every node has applied every other node's writes committed before the call.
    WaitSync {
        /// Seconds to wait before failing.
        #[arg(long, default_value_t = 60)]
        timeout: u64,
    },
    /// Stop applying node FROM's changes on node TO (FROM's slot keeps them); persists until resumed.
    Pause {
        #[arg(long)]
        from: String,
        #[arg(long)]
        to: String,
    },
    /// Restart applying node FROM's changes on node TO.
    Resume {
        #[arg(long)]
        from: String,
        #[arg(long)]
        to: String,
    },
    /// Recent resolved conflicts from every node's conflict log, newest first.
    Conflicts {
        /// Rows to show (after merging all nodes).
        #[arg(long, default_value_t = 20)]
        limit: u32,
    },
    /// Repair: on the --agent's node, skip node FROM's transaction that commits at LSN (audited in the conflict log).
    Skip {
        /// The node whose transaction is stuck.
        #[arg(long)]
        from: String,
        /// The stuck transaction's commit LSN, as shown in the stream's last error.
        #[arg(long)]
        lsn: String,
    },
}

/// mmctl's entry point.
pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(&e),
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return fail(&CtlError::new("starting", e)),
    };
    match runtime.block_on(run(&cli)) {
        Ok(out) => {
            if cli.json {
                match serde_json::to_string_pretty(&out.json) {
                    Ok(s) => println!("{s}"),
                    Err(e) => return fail(&CtlError::new("encoding JSON output", e)),
                }
            } else if !out.human.is_empty() {
                print!("{}", out.human);
                if !out.human.ends_with('\n') {
                    println!();
                }
            }
            ExitCode::SUCCESS
        }
        Err(e) => fail(&e),
    }
}

/// Runs the parsed command.
pub async fn run(cli: &Cli) -> Result<Output, CtlError> {
    let token = read_token(&cli.token_file).map_err(|why| CtlError::new("authentication", why))?;
    let c = AgentClient::new(token).map_err(|why| CtlError::new("starting", why))?;
    let agent = cli.agent.trim_end_matches('/');
    match &cli.command {
        Command::Init => commands::init(&c, agent).await,
        Command::AddNode { name, url } => commands::add_node(&c, agent, name, url).await,
        Command::Status => commands::status(&c, agent).await,
        Command::WaitSync { timeout } => {
            commands::wait_sync(&c, agent, Duration::from_secs(*timeout)).await
        }
        Command::Pause { from, to } => commands::pause(&c, agent, from, to, true).await,
        Command::Resume { from, to } => commands::pause(&c, agent, from, to, false).await,
        Command::Conflicts { limit } => commands::conflicts(&c, agent, *limit).await,
        Command::Skip { from, lsn } => commands::skip(&c, agent, from, lsn).await,
    }
}

fn fail(e: &CtlError) -> ExitCode {
    eprintln!("mmctl: {}: {}", one_line(&e.what), one_line(&e.why));
    ExitCode::from(1)
}

/// Help and version go to stdout with exit 0; real usage errors are one line, exit 2.
fn usage_error(e: &clap::Error) -> ExitCode {
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            print!("{e}");
            ExitCode::SUCCESS
        }
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand | ErrorKind::MissingSubcommand => {
            eprintln!(
                "mmctl: usage: a command is required (init, add-node, status, wait-sync, pause, resume, conflicts, skip); see mmctl --help"
            );
            ExitCode::from(2)
        }
        _ => {
            let rendered = e.to_string();
            let first = rendered
                .lines()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("invalid arguments");
            let first = first.strip_prefix("error: ").unwrap_or(first);
            eprintln!("mmctl: usage: {}; see mmctl --help", one_line(first));
            ExitCode::from(2)
        }
    }
}
