//! The mm-agent configuration (SPEC §3): a TOML file plus `MM_<SECTION>__<KEY>`
//! environment overrides, loaded with the `config` crate and validated into
//! typed sections.
//!
//! Loading is all-or-nothing: an `AgentConfig` only exists if every rule
//! holds, so the agent never starts half-configured. Unknown keys are errors
//! (a typo must not silently fall back to a default), and errors name the
//! dotted key, the bad value (never a secret) and, for overrides, the
//! environment variable.

mod error;
mod raw;
mod secret;
mod validate;

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap (project rule)
mod tests;

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::Serialize;

pub use error::{ConfigError, Origin};
pub use secret::read_secret;
pub use validate::{AGENT_SCHEMA, DEFAULT_LISTEN};

/// A validated agent configuration. Holds no secrets, only the files that
/// contain them, so it is safe to log or show in status (it is `Serialize`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AgentConfig {
    pub node: NodeSection,
    pub postgres: PostgresSection,
    pub api: ApiSection,
    pub replication: ReplicationSection,
    pub conflicts: ConflictsSection,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeSection {
    /// Unique in the cluster; `[a-z0-9_-]{1,32}` so it can be embedded in
    /// replication origin and slot names (`mm_<node>`) without quoting.
    pub name: String,
    /// The agent's own durable state (Raft log, vote, snapshots).
    pub data_dir: PathBuf,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PostgresSection {
    /// How this agent reaches its local node. Parses as a libpq connection
    /// string and contains no password.
    pub dsn: String,
    /// How peers reach this node. Same rules as `dsn`.
    pub peer_dsn: String,
    /// The password for both DSNs' role, if the server asks for one.
    pub password_file: Option<PathBuf>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ApiSection {
    /// Default `127.0.0.1:7601`.
    pub listen: SocketAddr,
    /// An `http://` or `https://` URL without trailing slash (https whenever
    /// `tls_cert` is set). Defaults to the scheme plus `listen`, unless
    /// `listen` is a wildcard address, in which case it is required.
    pub advertise: String,
    pub token_file: PathBuf,
    /// Set together with `tls_key` or not at all.
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    /// CA bundle used to verify peers; the system roots when absent.
    pub tls_ca: Option<PathBuf>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReplicationSection {
    /// Non-empty, distinct identifiers, never `mm` nor a system schema.
    /// Default `["public"]`.
    pub schemas: Vec<String>,
    pub synchronous_commit: SyncCommit,
    /// `replication.apply_lanes`, 1..=64, default 1: apply sessions per
    /// peer. Above 1, transactions whose write sets are disjoint apply on
    /// several sessions at once and still commit in the publisher's order
    /// (the agent's `apply/lanes.rs`, docs/ARCHITECTURE.md "Parallel apply
    /// lanes").
    pub apply_lanes: u32,
    /// `replication.group_transactions`, 1..=1000, default 1: how many
    /// small remote transactions a stream that is behind may apply as one
    /// local transaction (the agent's `apply/group.rs`). Above 1, rows such
    /// a group writes carry its last transaction's commit timestamp rather
    /// than each their own; conflict decisions stay the same (the agent
    /// groups only when they provably do), row versions then differ from
    /// the origin's by up to the group's span.
    pub group_transactions: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ConflictsSection {
    /// A valid [`ResolverSpec`] string. Default `last_writer_wins`.
    pub resolver: String,
    /// `"schema.table"` (a table in a replicated schema) -> resolver spec.
    pub tables: BTreeMap<String, String>,
}

impl ConflictsSection {
    /// The resolver configured for a table: its override, else the default.
    pub fn resolver_for(&self, schema: &str, table: &str) -> &str {
        self.tables
            .get(&format!("{schema}.{table}"))
            .map_or(self.resolver.as_str(), String::as_str)
    }
}

/// `synchronous_commit` for the agent's apply sessions. Defaults to `off`:
/// apply throughput matters and crash safety does not depend on it, because
/// the agent only acknowledges to the publisher what is flushed locally.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SyncCommit {
    #[default]
    Off,
    Local,
    On,
    RemoteWrite,
    RemoteApply,
}

impl SyncCommit {
    /// The value as PostgreSQL spells it, for `SET synchronous_commit = ...`.
    pub fn as_str(self) -> &'static str {
        match self {
            SyncCommit::Off => "off",
            SyncCommit::Local => "local",
            SyncCommit::On => "on",
            SyncCommit::RemoteWrite => "remote_write",
            SyncCommit::RemoteApply => "remote_apply",
        }
    }
}

impl fmt::Display for SyncCommit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SyncCommit {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "off" => SyncCommit::Off,
            "local" => SyncCommit::Local,
            "on" => SyncCommit::On,
            "remote_write" => SyncCommit::RemoteWrite,
            "remote_apply" => SyncCommit::RemoteApply,
            _ => return Err("must be one of off, local, on, remote_write, remote_apply".into()),
        })
    }
}

/// A parsed resolver name (SPEC §6). The config keeps the string; the agent
/// parses it with `str::parse::<ResolverSpec>()`, which cannot fail for a
/// string that passed validation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResolverSpec {
    LastWriterWins,
    FirstWriterWins,
    ApplyRemote,
    KeepLocal,
    Error,
    /// `sql:SCHEMA.FUNC`: a user function `(conflict jsonb) returns jsonb`.
    Sql {
        schema: String,
        function: String,
    },
    /// `rust:NAME`: a Rust resolver registered by the binary that embeds the
    /// agent (the agent refuses to start when NAME is not registered).
    Custom(String),
}

impl FromStr for ResolverSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "last_writer_wins" => ResolverSpec::LastWriterWins,
            "first_writer_wins" => ResolverSpec::FirstWriterWins,
            "apply_remote" => ResolverSpec::ApplyRemote,
            "keep_local" => ResolverSpec::KeepLocal,
            "error" => ResolverSpec::Error,
            other => {
                let bad = || {
                    "must be one of last_writer_wins, first_writer_wins, apply_remote, \
                     keep_local, error, sql:SCHEMA.FUNC, rust:NAME"
                        .to_owned()
                };
                if let Some(name) = other.strip_prefix("rust:") {
                    validate::identifier(name)
                        .map_err(|reason| format!("rust:NAME needs an identifier; {reason}"))?;
                    return Ok(ResolverSpec::Custom(name.to_owned()));
                }
                let target = other.strip_prefix("sql:").ok_or_else(bad)?;
                let (schema, function) = target.split_once('.').ok_or_else(bad)?;
                validate::identifier(schema)
                    .and_then(|()| validate::identifier(function))
                    .map_err(|reason| format!("sql:SCHEMA.FUNC needs two identifiers; {reason}"))?;
                ResolverSpec::Sql {
                    schema: schema.to_owned(),
                    function: function.to_owned(),
                }
            }
        })
    }
}

impl fmt::Display for ResolverSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ResolverSpec::LastWriterWins => f.write_str("last_writer_wins"),
            ResolverSpec::FirstWriterWins => f.write_str("first_writer_wins"),
            ResolverSpec::ApplyRemote => f.write_str("apply_remote"),
            ResolverSpec::KeepLocal => f.write_str("keep_local"),
            ResolverSpec::Error => f.write_str("error"),
            ResolverSpec::Sql { schema, function } => write!(f, "sql:{schema}.{function}"),
            ResolverSpec::Custom(name) => write!(f, "rust:{name}"),
        }
    }
}

impl AgentConfig {
    /// Loads `path` with overrides from the process environment.
    pub fn load(path: &Path) -> Result<AgentConfig, ConfigError> {
        // Non-UTF-8 variables cannot be ours (all keys and values are text).
        let env = std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)));
        Self::load_with_env(path, env)
    }

    /// Loads `path` with overrides from `env` instead of the process
    /// environment, so tests need not mutate global state.
    pub fn load_with_env(
        path: &Path,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<AgentConfig, ConfigError> {
        if !path.is_file() {
            return Err(ConfigError::Load {
                message: format!("{} is not a readable file", path.display()),
            });
        }
        let builder = config::Config::builder().add_source(
            config::File::from(path)
                .format(config::FileFormat::Toml)
                .required(true),
        );
        let (raw, origins) = raw::load(builder, env)?;
        validate::to_agent_config(raw, &origins)
    }

    /// Parses TOML text with no environment overrides.
    pub fn from_toml_str(toml: &str) -> Result<AgentConfig, ConfigError> {
        Self::from_toml_str_with_env(toml, std::iter::empty())
    }

    /// Parses TOML text with overrides from `env`.
    pub fn from_toml_str_with_env(
        toml: &str,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<AgentConfig, ConfigError> {
        let builder = config::Config::builder()
            .add_source(config::File::from_str(toml, config::FileFormat::Toml));
        let (raw, origins) = raw::load(builder, env)?;
        validate::to_agent_config(raw, &origins)
    }

    /// The shared cluster token from `api.token_file`.
    pub fn token(&self) -> Result<String, ConfigError> {
        read_secret(&self.api.token_file)
    }

    /// The PostgreSQL password from `postgres.password_file`, if configured.
    pub fn password(&self) -> Result<Option<String>, ConfigError> {
        self.postgres
            .password_file
            .as_ref()
            .map(read_secret)
            .transpose()
    }
}
