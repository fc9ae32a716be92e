//! The configuration exactly as written: every leaf a string, so that all
//! value checks happen in one place (`validate`) with errors that name the key
//! and the bad value, instead of serde's generic "invalid type" messages.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::error::{ConfigError, Origin};

/// Environment variables carrying overrides start with this.
const ENV_PREFIX: &str = "MM_";
/// Separates the section from the key in an override variable's name.
const ENV_SEPARATOR: &str = "__";
/// Keys whose environment override is a comma-separated list.
const LIST_KEYS: &[&str] = &["replication.schemas"];

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawConfig {
    pub node: RawNode,
    pub postgres: RawPostgres,
    pub api: RawApi,
    #[serde(default)]
    pub replication: RawReplication,
    #[serde(default)]
    pub conflicts: RawConflicts,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawNode {
    pub name: String,
    pub data_dir: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawPostgres {
    pub dsn: String,
    pub peer_dsn: String,
    #[serde(default)]
    pub password_file: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawApi {
    #[serde(default)]
    pub listen: Option<String>,
    #[serde(default)]
    pub advertise: Option<String>,
    pub token_file: String,
    #[serde(default)]
    pub tls_cert: Option<String>,
    #[serde(default)]
    pub tls_key: Option<String>,
    #[serde(default)]
    pub tls_ca: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawReplication {
    #[serde(default)]
    pub schemas: Option<Vec<String>>,
    #[serde(default)]
    pub synchronous_commit: Option<String>,
    /// An integer in TOML, a string from the environment.
    #[serde(default)]
    pub apply_lanes: Option<IntOrString>,
    #[serde(default)]
    pub group_transactions: Option<IntOrString>,
}

/// A number as TOML writes it or as an environment variable carries it.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum IntOrString {
    Int(i64),
    Str(String),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawConflicts {
    #[serde(default)]
    pub resolver: Option<String>,
    #[serde(default)]
    pub tables: BTreeMap<String, String>,
}

/// Which environment variable set which dotted key, for error messages.
#[derive(Debug, Default)]
pub(crate) struct EnvOrigins(BTreeMap<String, String>);

impl EnvOrigins {
    /// The origin of `key` or of the closest enclosing key that was overridden.
    pub fn origin_of(&self, key: &str) -> Origin {
        let mut probe = key;
        loop {
            if let Some(var) = self.0.get(probe) {
                return Origin::Env(var.clone());
            }
            match probe.rsplit_once('.') {
                Some((parent, _)) => probe = parent,
                None => return Origin::File,
            }
        }
    }
}

/// Parses `source` (already added to `builder`) plus environment overrides
/// into the raw form.
pub(crate) fn load(
    builder: config::ConfigBuilder<config::builder::DefaultState>,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<(RawConfig, EnvOrigins), ConfigError> {
    let mut builder = builder;
    let mut origins = EnvOrigins::default();
    for (var, value) in env {
        let Some(key) = env_key(&var)? else {
            continue;
        };
        builder = if LIST_KEYS.contains(&key.as_str()) {
            let items: Vec<String> = value
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect();
            builder.set_override(key.as_str(), items)
        } else {
            builder.set_override(key.as_str(), value)
        }
        .map_err(|e| ConfigError::Env {
            var: var.clone(),
            reason: e.to_string(),
        })?;
        origins.0.insert(key, var);
    }
    let merged = builder.build().map_err(|e| ConfigError::Load {
        message: e.to_string(),
    })?;
    let raw = merged
        .try_deserialize::<RawConfig>()
        .map_err(|e| map_deserialize_error(e, &origins))?;
    Ok((raw, origins))
}

/// Maps `MM_SECTION__KEY` to `section.key`; `None` for variables that are not
/// overrides at all.
///
/// Variables without the `__` separator (e.g. `MM_PG_BIN`, used by the test
/// harness) are someone else's and ignored, so they cannot break the agent;
/// variables with it are ours, and a bad one is an error rather than silently
/// ignored, because a mistyped override would otherwise go unnoticed.
fn env_key(var: &str) -> Result<Option<String>, ConfigError> {
    let Some(rest) = var.strip_prefix(ENV_PREFIX) else {
        return Ok(None);
    };
    if !rest.contains(ENV_SEPARATOR) {
        return Ok(None);
    }
    let parts: Vec<&str> = rest.split(ENV_SEPARATOR).collect();
    let well_formed = parts.len() == 2
        && parts
            .iter()
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'));
    if !well_formed {
        return Err(ConfigError::Env {
            var: var.to_owned(),
            reason: "overrides must be named MM_<SECTION>__<KEY>, e.g. MM_POSTGRES__DSN".into(),
        });
    }
    Ok(Some(parts.join(".").to_ascii_lowercase()))
}

/// Turns the `config` crate's deserialization errors into ones that name the
/// full dotted key.
///
/// `config` reports an unknown or missing field as serde's message
/// ("unknown field `x`, expected ...") with only the enclosing section as its
/// key, so the two are joined here; the tests pin this behaviour so an
/// upgrade of `config` that changes it is caught.
fn map_deserialize_error(err: config::ConfigError, origins: &EnvOrigins) -> ConfigError {
    let (section, inner) = match err {
        config::ConfigError::At {
            error,
            key: Some(k),
            ..
        } => (Some(k), *error),
        other => (None, other),
    };
    let join = |field: &str| match &section {
        Some(s) => format!("{s}.{field}"),
        None => field.to_owned(),
    };
    match inner {
        config::ConfigError::Message(msg) => {
            if let Some(field) = backticked_after(&msg, "unknown field ") {
                let key = join(&field);
                let origin = origins.origin_of(&key);
                return ConfigError::UnknownKey { key, origin };
            }
            if let Some(field) = backticked_after(&msg, "missing field ") {
                return ConfigError::Missing { key: join(&field) };
            }
            let key = section.unwrap_or_default();
            ConfigError::WrongType {
                origin: origins.origin_of(&key),
                key,
                message: msg,
            }
        }
        config::ConfigError::NotFound(key) => ConfigError::Missing { key },
        config::ConfigError::Type {
            unexpected,
            expected,
            key,
            ..
        } => {
            let key = key.or(section).unwrap_or_default();
            ConfigError::WrongType {
                origin: origins.origin_of(&key),
                key,
                message: format!("found {unexpected}, expected {expected}"),
            }
        }
        other => ConfigError::Load {
            message: match section {
                Some(s) => format!("{other} (at `{s}`)"),
                None => other.to_string(),
            },
        },
    }
}

/// `backticked_after("unknown field `x`, ...", "unknown field ")` is `x`.
fn backticked_after(msg: &str, prefix: &str) -> Option<String> {
    let rest = msg.strip_prefix(prefix)?.strip_prefix('`')?;
    let end = rest.find('`')?;
    Some(rest[..end].to_owned())
}
