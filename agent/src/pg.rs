//! Connections to the local PostgreSQL node (ordinary SQL via tokio-postgres).

use tokio_postgres::{Client, NoTls};

/// Session settings that make text values portable between nodes, whatever the
/// database or role defaults say (the same ones PostgreSQL's walreceiver forces).
/// Used on the apply session AND as startup parameters of replication connections.
pub const PORTABLE_SESSION_PARAMS: &[(&str, &str)] = &[
    ("datestyle", "ISO"),
    ("intervalstyle", "postgres"),
    ("extra_float_digits", "3"),
    ("timezone", "UTC"),
    ("search_path", ""),
    ("bytea_output", "hex"),
    ("standard_conforming_strings", "on"),
];

#[derive(Debug, thiserror::Error)]
pub enum PgError {
    #[error("invalid connection string: {0}")]
    Dsn(String),
    #[error("cannot connect to PostgreSQL ({target}): {source}")]
    Connect {
        target: String,
        #[source]
        source: tokio_postgres::Error,
    },
}

/// Describes where a DSN points without revealing secrets (for errors and logs).
pub fn describe_dsn(dsn: &str) -> String {
    match dsn.parse::<tokio_postgres::Config>() {
        Ok(cfg) => {
            let host = cfg
                .get_hosts()
                .first()
                .map(|h| match h {
                    tokio_postgres::config::Host::Tcp(s) => s.clone(),
                    tokio_postgres::config::Host::Unix(p) => p.display().to_string(),
                })
                .unwrap_or_else(|| "localhost".into());
            let port = cfg.get_ports().first().copied().unwrap_or(5432);
            format!(
                "host={host} port={port} dbname={}",
                cfg.get_dbname().unwrap_or("?")
            )
        }
        Err(_) => "<unparseable dsn>".into(),
    }
}

/// Connects with the given (optional) password and spawns the connection task.
/// Startup parameters pin the portable session settings.
/// Binds the session to replication origin `origin`, created if missing:
/// its commits then carry that origin (and the timestamp a transaction
/// sets with `pg_replication_origin_xact_setup`). Apply sessions and the
/// add-node copy both write under origins this way.
pub async fn bind_origin(client: &Client, origin: &str) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "SELECT pg_catalog.pg_replication_origin_create($1) \
             WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_replication_origin WHERE roname = $1)",
            &[&origin],
        )
        .await?;
    setup_origin(client, origin).await
}

/// Binds the session to replication origin `origin`, which exists.
pub async fn setup_origin(client: &Client, origin: &str) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "SELECT pg_catalog.pg_replication_origin_session_setup($1)",
            &[&origin],
        )
        .await?;
    Ok(())
}

/// An apply session of the agent's own (`apply/pipeline.rs`): the same
/// DSN, password and portable settings as `connect`, then `settings` run
/// one by one. Local sessions do not use TLS, as `connect` does not.
pub async fn connect_pipelined(
    dsn: &str,
    password: Option<&str>,
    settings: &[String],
) -> Result<mm_proto::client::PipelinedSession, String> {
    let mut cfg = mm_proto::client::ReplicationConfig::from_dsn(dsn)
        .map_err(|e| e.to_string())?
        .with_ssl_mode(mm_proto::client::SslMode::Disable);
    if let Some(pw) = password {
        cfg = cfg.with_password(pw);
    }
    for (k, v) in PORTABLE_SESSION_PARAMS {
        cfg = cfg.with_param(*k, *v);
    }
    if cfg.application_name().is_none() {
        cfg = cfg.with_application_name("mm-agent");
    }
    let mut session = mm_proto::client::PipelinedSession::connect(&cfg)
        .await
        .map_err(|e| format!("cannot connect to PostgreSQL ({}): {e}", describe_dsn(dsn)))?;
    for sql in settings {
        session
            .query(sql, &[])
            .await
            .map_err(|e| format!("{sql}: {e}"))?;
    }
    Ok(session)
}

pub async fn connect(dsn: &str, password: Option<&str>) -> Result<Client, PgError> {
    let mut cfg: tokio_postgres::Config = dsn
        .parse()
        .map_err(|e: tokio_postgres::Error| PgError::Dsn(e.to_string()))?;
    if let Some(pw) = password {
        cfg.password(pw);
    }
    let options: String = PORTABLE_SESSION_PARAMS
        .iter()
        .map(|(k, v)| {
            if v.is_empty() {
                format!("-c {k}=")
            } else {
                format!("-c {k}={v}")
            }
        })
        .collect::<Vec<_>>()
        .join(" ");
    cfg.options(&options);
    if cfg.get_application_name().is_none() {
        cfg.application_name("mm-agent");
    }
    let (client, conn) = cfg
        .connect(NoTls)
        .await
        .map_err(|source| PgError::Connect {
            target: describe_dsn(dsn),
            source,
        })?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "local PostgreSQL connection ended");
        }
    });
    Ok(client)
}
