//! `mm-agent` startup: configuration, prerequisites, the agent's SQL objects,
//! Raft, the HTTP API and the reconciler, in that order — each step refuses to
//! go on with one clear error rather than run half-configured.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use mm_cluster_config::AgentConfig;
use tracing::info;

use crate::api::{self, AppState};
use crate::cluster::Reconciler;
use crate::conflict::ResolverRegistry;
use crate::status::StatusRegistry;
use crate::stream::LocalNode;

#[derive(clap::Parser)]
#[command(
    version,
    after_help = "\
One mm-agent runs beside every PostgreSQL node of an mm cluster: it streams this
node's writes to every other node and applies theirs here. Start it with its
config file, then form the cluster with mmctl (mmctl init on one node, mmctl
add-node for the others):

  mm-agent --config /etc/mm/agent.toml

The config's keys are explained in mm-agent.example.toml (in the release
tarball; agent/ in the source). At start the agent checks the node's
prerequisites (PostgreSQL 16+, wal_level = logical, track_commit_timestamp = on,
enough slots and senders, a role with REPLICATION) and names every unmet one.
It logs to stderr; MM_LOG sets the filter (default info). See README.md."
)]
struct Args {
    /// The agent's TOML configuration file (keys may be overridden by MM_<SECTION>__<KEY>).
    #[arg(long, short = 'c', env = "MM_CONFIG")]
    config: std::path::PathBuf,
}

/// The whole of an agent binary: its arguments, logging (`MM_LOG`), the
/// config, the runtime, and the daemon with `registry`'s resolvers. Shared by
/// `mm-agent` and binaries that embed it with resolvers of their own, so
/// they take the same arguments.
pub fn main(program: &'static str, about: &'static str, registry: ResolverRegistry) -> ExitCode {
    use clap::{CommandFactory, FromArgMatches};
    let args = Args::command()
        .name(program)
        .about(about)
        .try_get_matches()
        .and_then(|m| Args::from_arg_matches(&m))
        .unwrap_or_else(|e| e.exit());
    let config = args.config.as_path();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("MM_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // Colour only on a terminal: journald, files and log shippers get
        // plain text (NO_COLOR also turns it off).
        .with_ansi(
            std::io::IsTerminal::is_terminal(&std::io::stderr())
                && std::env::var_os("NO_COLOR").is_none(),
        )
        .init();
    let cfg = match AgentConfig::load(config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{program}: {e}");
            return ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{program}: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run_with(cfg, registry)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{program}: {e:#}");
            ExitCode::FAILURE
        }
    }
}

pub async fn run(cfg: AgentConfig) -> anyhow::Result<()> {
    run_with(cfg, ResolverRegistry::builtin()).await
}

/// Runs the agent with extra Rust resolvers (`rust:NAME` in the config)
/// registered by the binary that embeds it.
pub async fn run_with(cfg: AgentConfig, registry: ResolverRegistry) -> anyhow::Result<()> {
    let name = cfg.node.name.clone();
    // Refuse rather than silently serve plain HTTP when TLS was asked for.
    if cfg.api.tls_cert.is_some() || cfg.api.tls_ca.is_some() {
        anyhow::bail!(
            "node {name}: api.tls_cert / api.tls_ca are not supported by this version: the API serves plain HTTP; terminate TLS in front of it or remove the keys"
        );
    }
    let resolvers = crate::conflict::TableResolvers::from_config(
        &registry,
        &cfg.conflicts.resolver,
        &cfg.conflicts.tables,
    )
    .map_err(|e| anyhow::anyhow!("node {name}: {e}"))?;
    let token: Arc<str> = Arc::from(cfg.token().context("reading api.token_file")?.as_str());
    let password = cfg.password().context("reading postgres.password_file")?;
    let schemas = cfg.replication.schemas.clone();

    let client = crate::pg::connect(&cfg.postgres.dsn, password.as_deref())
        .await
        .with_context(|| {
            format!("node {name}: connecting to the local PostgreSQL (postgres.dsn)")
        })?;
    crate::prereq::check(&client, &schemas, 2, cfg.replication.apply_lanes as usize)
        .await
        .with_context(|| format!("node {name}"))?;
    crate::schema::ensure(&client, &schemas)
        .await
        .with_context(|| format!("node {name}: creating schema mm and publication mm"))?;
    drop(client);

    std::fs::create_dir_all(&cfg.node.data_dir)
        .with_context(|| format!("creating node.data_dir {}", cfg.node.data_dir.display()))?;
    let node_id = crate::raft::load_or_create_node_id(&cfg.node.data_dir)?;
    let raft = crate::raft::start(
        node_id,
        &cfg.node.data_dir,
        &cfg.api.advertise,
        Arc::clone(&token),
    )
    .await
    .context("starting Raft")?;

    let status = Arc::new(StatusRegistry::new(&name));
    let sync_progress = Arc::new(crate::sync::Progress::default());
    let listener = tokio::net::TcpListener::bind(cfg.api.listen)
        .await
        .with_context(|| format!("binding api.listen {}", cfg.api.listen))?;
    info!(node = %name, node_id, listen = %cfg.api.listen, "agent API listening");
    if cfg.replication.apply_lanes > 1 {
        info!(
            node = %name,
            apply_lanes = cfg.replication.apply_lanes,
            "parallel apply: each peer's stream applies on this many sessions, committing in the peer's order"
        );
    }
    let gate = crate::apply::Gate::new();
    let state = AppState {
        raft: raft.clone(),
        token: Arc::clone(&token),
        node_name: name.clone(),
        api_url: cfg.api.advertise.clone(),
        peer_dsn: cfg.postgres.peer_dsn.clone(),
        local_dsn: cfg.postgres.dsn.clone(),
        local_password: password.clone(),
        status: Arc::clone(&status),
        join: crate::join::JoinOptions::default(),
        sync: Arc::clone(&sync_progress),
        gate: gate.clone(),
    };
    let server = tokio::spawn(api::serve(listener, state));

    let watermarks = Arc::new(crate::watermark::Watermarks::new(&name));
    let local = LocalNode {
        name: name.clone(),
        dsn: cfg.postgres.dsn.clone(),
        password,
        data_dir: cfg.node.data_dir.clone(),
        synchronous_commit: cfg.replication.synchronous_commit.as_str().to_owned(),
        apply_lanes: cfg.replication.apply_lanes as usize,
        group_transactions: cfg.replication.group_transactions as usize,
        status: Arc::clone(&status),
        resolvers: Arc::new(resolvers),
        watermarks: Arc::clone(&watermarks),
        gate: gate.clone(),
        token: Arc::clone(&token),
    };
    let watermark_task = tokio::spawn(crate::watermark::run(
        cfg.postgres.dsn.clone(),
        local.password.clone(),
        watermarks,
        status,
    ));
    let lag_probe = tokio::spawn(
        crate::lag::Probe {
            local_node: name.clone(),
            local_dsn: cfg.postgres.dsn.clone(),
            password: local.password.clone(),
            status: Arc::clone(&local.status),
        }
        .run(raft.cluster()),
    );
    let compensator = tokio::spawn(crate::compensate::run(
        cfg.postgres.dsn.clone(),
        local.password.clone(),
        gate,
    ));
    let sequences = tokio::spawn(
        crate::sequences::Manager {
            node: name.clone(),
            dsn: cfg.postgres.dsn.clone(),
            password: local.password.clone(),
            api_url: cfg.api.advertise.clone(),
            token: Arc::clone(&token),
        }
        .run(raft.cluster()),
    );
    let syncer = tokio::spawn(
        crate::sync::Syncer {
            node: name.clone(),
            dsn: cfg.postgres.dsn.clone(),
            password: local.password.clone(),
            progress: sync_progress,
        }
        .run(raft.cluster()),
    );
    let reconciler = tokio::spawn(Reconciler::new(local).run(raft.cluster()));

    shutdown_signal().await;
    info!(node = %name, "shutting down");
    reconciler.abort();
    syncer.abort();
    compensator.abort();
    sequences.abort();
    lag_probe.abort();
    watermark_task.abort();
    server.abort();
    let _ = raft.shutdown().await;
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
