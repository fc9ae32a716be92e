//! mmctl, the operator's CLI: argument parsing, dispatch, and the exit-code
//! contract (0 success; 1 failure; 2 usage) with one
//! `mmctl: <what failed>: <why>` line on stderr when it fails (one per
//! stream when several streams are the reason).

pub mod client;
pub mod commands;
mod join;
pub mod output;
mod part;
mod sequence;

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
    about = "Operate an mm multi-master PostgreSQL cluster",
    after_help = "\
mmctl talks to one agent's API (--agent, default http://127.0.0.1:7601) with the
cluster token (--token-file, default /etc/mm/token); any agent of the cluster
will do. A new cluster:

  mmctl --agent http://10.0.0.1:7601 init
  mmctl --agent http://10.0.0.1:7601 add-node --name n2 --url http://10.0.0.2:7601
  mmctl status

mmctl COMMAND --help tells more of each command. Exit 0 on success, non-zero with
one line saying why on failure; --json prints machine-readable output."
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
        /// The new node's name, as in its agent's config (node.name).
        #[arg(long)]
        name: String,
        /// The new node's agent API URL (its api.advertise).
        #[arg(long)]
        url: String,
        /// The active node to copy the data from (default: the least
        /// lagged one).
        #[arg(long)]
        source: Option<String>,
    },
    /// Part node NAME from the cluster, whether it is up or down: streams
    /// to and from it stop, its slots and origins are dropped everywhere,
    /// it leaves Raft; if it comes back it is fenced.
    RemoveNode {
        /// The node to remove.
        #[arg(long)]
        name: String,
    },
    /// Nodes, Raft leader and term, and every stream between nodes.
    Status,
    /// Wait until every node has applied every other node's writes committed before the call.
    /// Fails at once when a stream it waits for is stopped by an error, or is
    /// paused with changes waiting (unless --ignore-paused).
    WaitSync {
        /// Seconds to wait before failing.
        #[arg(long, default_value_t = 60)]
        timeout: u64,
        /// Leave paused streams out of the barrier (for orchestrated tests
        /// and maintenance).
        #[arg(long)]
        ignore_paused: bool,
    },
    /// Stop applying node FROM's changes on node TO (FROM's slot keeps them); persists until resumed.
    Pause {
        /// The publishing node whose changes stop being applied.
        #[arg(long)]
        from: String,
        /// The node that stops applying them.
        #[arg(long)]
        to: String,
    },
    /// Restart applying node FROM's changes on node TO.
    Resume {
        /// The publishing node.
        #[arg(long)]
        from: String,
        /// The node that applies its changes again.
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
    /// Cluster-global sequences: disjoint chunks per node, from Raft.
    Sequence {
        #[command(subcommand)]
        command: SequenceCommand,
    },
    /// Online consistency check of the replicated tables (not built in this version).
    Verify {
        /// Only this table (schema-qualified).
        #[arg(long)]
        table: Option<String>,
    },
    /// Make the other nodes' rows of TABLE equal node SOURCE's (not built in this version).
    Repair {
        /// The table to repair (schema-qualified).
        #[arg(long)]
        table: String,
        /// The node whose rows are kept.
        #[arg(long)]
        source: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum SequenceCommand {
    /// Make sequence SEQ (schema-qualified) cluster-global.
    Add {
        /// The sequence, schema-qualified.
        seq: String,
        /// Values per range handed to a node.
        #[arg(long)]
        chunk: Option<u64>,
    },
    /// Global sequences with each node's current range and usage.
    List,
}

impl Command {
    fn name(&self) -> &'static str {
        match self {
            Command::Init => "init",
            Command::AddNode { .. } => "add-node",
            Command::RemoveNode { .. } => "remove-node",
            Command::Status => "status",
            Command::WaitSync { .. } => "wait-sync",
            Command::Pause { .. } => "pause",
            Command::Resume { .. } => "resume",
            Command::Conflicts { .. } => "conflicts",
            Command::Skip { .. } => "skip",
            Command::Sequence { .. } => "sequence",
            Command::Verify { .. } => "verify",
            Command::Repair { .. } => "repair",
        }
    }
}

/// A SPEC command this version does not have yet: say exactly that.
fn not_built(command: &str) -> CtlError {
    CtlError::new(
        command,
        format!(
            "not built in mmctl {}: this command is part of the mm specification but not implemented in this version",
            env!("CARGO_PKG_VERSION")
        ),
    )
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
            if out.failed {
                eprintln!(
                    "mmctl: {}: a stream is in error (shown above)",
                    cli.command.name()
                );
                return ExitCode::from(1);
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
        Command::AddNode { name, url, source } => {
            join::add_node(&c, agent, name, url, source.as_deref(), cli.json).await
        }
        Command::Status => commands::status(&c, agent).await,
        Command::WaitSync {
            timeout,
            ignore_paused,
        } => commands::wait_sync(&c, agent, Duration::from_secs(*timeout), *ignore_paused).await,
        Command::RemoveNode { name } => part::remove_node(&c, agent, name).await,
        Command::Sequence {
            command: SequenceCommand::Add { seq, chunk },
        } => sequence::add(&c, agent, seq, *chunk).await,
        Command::Sequence {
            command: SequenceCommand::List,
        } => sequence::list(&c, agent).await,
        Command::Verify { .. } => Err(not_built("verify")),
        Command::Repair { .. } => Err(not_built("repair")),
        Command::Pause { from, to } => commands::pause(&c, agent, from, to, true).await,
        Command::Resume { from, to } => commands::pause(&c, agent, from, to, false).await,
        Command::Conflicts { limit } => commands::conflicts(&c, agent, *limit).await,
        Command::Skip { from, lsn } => commands::skip(&c, agent, from, lsn).await,
    }
}

/// One line per failure; a failure about several things (wait-sync's stuck
/// streams) gives each its own line, every one with the same prefix.
fn fail(e: &CtlError) -> ExitCode {
    for line in e.why.lines().filter(|l| !l.trim().is_empty()) {
        eprintln!("mmctl: {}: {}", one_line(&e.what), one_line(line));
    }
    if e.why.trim().is_empty() {
        eprintln!("mmctl: {}: failed", one_line(&e.what));
    }
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
                "mmctl: usage: a command is required (init, add-node, status, wait-sync, pause, resume, conflicts, skip, ...); see mmctl --help"
            );
            ExitCode::from(2)
        }
        _ => {
            eprintln!("mmctl: usage: {}; see mmctl --help", usage_line(e));
            ExitCode::from(2)
        }
    }
}

/// clap's message as one line, up to the usage block: "the following
/// required arguments were not provided: --lsn <LSN>" names the flag on its
/// second line, which a first-line cut would lose.
fn usage_line(e: &clap::Error) -> String {
    let rendered = e.render().to_string();
    let parts: Vec<&str> = rendered
        .lines()
        .map(str::trim)
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .filter(|l| !l.is_empty())
        .collect();
    let joined = parts.join(" ");
    let joined = joined.strip_prefix("error: ").unwrap_or(&joined);
    if joined.is_empty() {
        "invalid arguments".to_owned()
    } else {
        one_line(joined)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn usage(args: &[&str]) -> String {
        match Cli::try_parse_from(args) {
            Ok(_) => panic!("{args:?} parsed"),
            Err(e) => usage_line(&e),
        }
    }

    #[test]
    fn a_missing_flag_is_named() {
        let m = usage(&["mmctl", "skip", "--from", "n1"]);
        assert!(m.contains("--lsn"), "{m}");
        let m = usage(&["mmctl", "pause", "--to", "n1"]);
        assert!(m.contains("--from"), "{m}");
        let m = usage(&["mmctl", "add-node", "--name", "n1"]);
        assert!(m.contains("--url"), "{m}");
        let m = usage(&["mmctl", "wait-sync", "--timeout", "soon"]);
        assert!(m.contains("soon") && m.contains("--timeout"), "{m}");
    }

    #[test]
    fn every_flag_and_command_has_help() {
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for a in cmd.get_arguments() {
                let id = a.get_id().as_str();
                if id == "help" || id == "version" {
                    continue;
                }
                if a.get_help().is_none() {
                    missing.push(format!("{path} {id}"));
                }
            }
            for sub in cmd.get_subcommands() {
                if sub.get_about().is_none() {
                    missing.push(format!("{path} {}", sub.get_name()));
                }
                walk(sub, &format!("{path} {}", sub.get_name()), missing);
            }
        }
        let mut missing = Vec::new();
        walk(&Cli::command(), "mmctl", &mut missing);
        assert!(missing.is_empty(), "no help text: {missing:?}");
    }
}
