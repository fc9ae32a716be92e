//! Value checks and conversion from the raw, all-strings form to the typed
//! configuration. Every rule of SPEC §3 is enforced here and nowhere else, so
//! a value that reaches `AgentConfig` is known good.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;

use crate::error::ConfigError;
use crate::raw::{EnvOrigins, RawConfig};
use crate::{
    AgentConfig, ApiSection, ConflictsSection, NodeSection, PostgresSection, ReplicationSection,
    ResolverSpec, SyncCommit,
};

/// The agent's own schema: holds the conflict log and Raft views and must
/// never be replicated, or nodes would overwrite each other's local state.
pub const AGENT_SCHEMA: &str = "mm";

/// Used when `api.listen` is not given: loopback, so an unconfigured agent is
/// never reachable from the network.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7601";

/// PostgreSQL truncates identifiers to NAMEDATALEN - 1 bytes.
const MAX_IDENTIFIER_LEN: usize = 63;

struct Checker<'a> {
    origins: &'a EnvOrigins,
}

impl Checker<'_> {
    fn invalid(&self, key: &str, value: &str, reason: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            key: key.to_owned(),
            value: value.to_owned(),
            reason: reason.into(),
            origin: self.origins.origin_of(key),
        }
    }

    fn path(&self, key: &str, value: String) -> Result<PathBuf, ConfigError> {
        if value.trim().is_empty() {
            return Err(self.invalid(key, &value, "must not be empty"));
        }
        Ok(PathBuf::from(value))
    }

    fn opt_path(&self, key: &str, value: Option<String>) -> Result<Option<PathBuf>, ConfigError> {
        value.map(|v| self.path(key, v)).transpose()
    }

    fn node_name(&self, name: String) -> Result<String, ConfigError> {
        let ok = (1..=32).contains(&name.len())
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
        if !ok {
            return Err(self.invalid(
                "node.name",
                &name,
                "must be 1 to 32 characters from [a-z0-9_-]",
            ));
        }
        Ok(name)
    }

    /// Accepts what tokio-postgres (and therefore the agent) can connect with.
    /// Passwords are refused outright: DSNs end up in logs, status output and
    /// Raft state shared with peers.
    fn dsn(&self, key: &str, dsn: String) -> Result<String, ConfigError> {
        if dsn.trim().is_empty() {
            return Err(self.invalid(key, &dsn, "must not be empty"));
        }
        match tokio_postgres::Config::from_str(&dsn) {
            Ok(parsed) => {
                if parsed.get_password().is_some() {
                    return Err(ConfigError::InlinePassword {
                        key: key.to_owned(),
                        origin: self.origins.origin_of(key),
                    });
                }
                Ok(dsn)
            }
            Err(e) => {
                if looks_like_it_has_password(&dsn) {
                    return Err(ConfigError::InlinePassword {
                        key: key.to_owned(),
                        origin: self.origins.origin_of(key),
                    });
                }
                Err(self.invalid(
                    key,
                    &dsn,
                    format!(
                        "not a libpq connection string (key=value ... or postgresql://...): {e}"
                    ),
                ))
            }
        }
    }

    fn listen(&self, listen: Option<String>) -> Result<SocketAddr, ConfigError> {
        let listen = listen.unwrap_or_else(|| DEFAULT_LISTEN.to_owned());
        listen.parse().map_err(|_| {
            self.invalid(
                "api.listen",
                &listen,
                "must be IP:PORT, e.g. 127.0.0.1:7601",
            )
        })
    }

    /// Peers and mmctl build request URLs by appending paths, so the URL is
    /// stored without a trailing slash.
    fn advertise(
        &self,
        advertise: Option<String>,
        listen: SocketAddr,
        tls: bool,
    ) -> Result<String, ConfigError> {
        let scheme = if tls { "https" } else { "http" };
        let url = match advertise {
            Some(url) => url,
            None if listen.ip().is_unspecified() => {
                return Err(ConfigError::Missing {
                    key: "api.advertise".into(),
                });
            }
            None => format!("{scheme}://{listen}"),
        };
        let rest = if let Some(rest) = url.strip_prefix("https://") {
            rest
        } else if let Some(rest) = url.strip_prefix("http://") {
            if tls {
                return Err(self.invalid(
                    "api.advertise",
                    &url,
                    "must be an https:// URL because api.tls_cert is set",
                ));
            }
            rest
        } else {
            return Err(self.invalid("api.advertise", &url, "must be an http:// or https:// URL"));
        };
        let authority = rest.split('/').next().unwrap_or_default();
        if authority.is_empty()
            || url.chars().any(|c| c.is_whitespace() || c.is_control())
            || authority.contains('@')
            || !port_ok(authority)
        {
            return Err(self.invalid(
                "api.advertise",
                &url,
                "must be http(s)://HOST[:PORT][/PATH]",
            ));
        }
        Ok(url.trim_end_matches('/').to_owned())
    }

    fn schemas(&self, schemas: Option<Vec<String>>) -> Result<Vec<String>, ConfigError> {
        let key = "replication.schemas";
        let schemas = schemas.unwrap_or_else(|| vec!["public".to_owned()]);
        if schemas.is_empty() {
            return Err(self.invalid(key, "[]", "must list at least one schema"));
        }
        let mut seen = BTreeSet::new();
        for s in &schemas {
            if let Err(reason) = identifier(s) {
                return Err(self.invalid(key, s, reason));
            }
            if s == AGENT_SCHEMA {
                return Err(self.invalid(
                    key,
                    s,
                    "is the agent's own schema, which is never replicated",
                ));
            }
            if s.starts_with("pg_") || s == "information_schema" {
                return Err(self.invalid(key, s, "system schemas cannot be replicated"));
            }
            if !seen.insert(s.as_str()) {
                return Err(self.invalid(key, s, "listed twice"));
            }
        }
        Ok(schemas)
    }

    fn sync_commit(&self, value: Option<String>) -> Result<SyncCommit, ConfigError> {
        match value {
            None => Ok(SyncCommit::default()),
            Some(v) => SyncCommit::from_str(&v)
                .map_err(|reason| self.invalid("replication.synchronous_commit", &v, reason)),
        }
    }

    /// An integer key from `min` to `max`, `default` when absent.
    fn int_in(
        &self,
        key: &str,
        value: Option<crate::raw::IntOrString>,
        (min, max, default): (i64, i64, u32),
    ) -> Result<u32, ConfigError> {
        let (text, n) = match value {
            None => return Ok(default),
            Some(crate::raw::IntOrString::Int(n)) => (n.to_string(), Some(n)),
            Some(crate::raw::IntOrString::Str(s)) => {
                let n = s.trim().parse::<i64>().ok();
                (s, n)
            }
        };
        match n.filter(|n| (min..=max).contains(n)) {
            Some(n) => u32::try_from(n).map_err(|_| {
                self.invalid(
                    key,
                    &text,
                    format!("must be an integer from {min} to {max}"),
                )
            }),
            None => Err(self.invalid(
                key,
                &text,
                format!("must be an integer from {min} to {max}"),
            )),
        }
    }

    fn resolver(&self, key: &str, value: String) -> Result<String, ConfigError> {
        match ResolverSpec::from_str(&value) {
            Ok(_) => Ok(value),
            Err(reason) => Err(self.invalid(key, &value, reason)),
        }
    }
}

/// Checks a name the agent will put in SQL as an identifier. Quoted, mixed
/// case names are allowed (the agent always quotes); what is refused could not
/// round-trip through catalogs and logs unambiguously.
pub(crate) fn identifier(s: &str) -> Result<(), String> {
    let mut bytes = s.bytes();
    let first_ok = matches!(bytes.next(), Some(b) if b.is_ascii_alphabetic() || b == b'_');
    if !first_ok
        || s.len() > MAX_IDENTIFIER_LEN
        || !bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'$')
    {
        return Err(format!(
            "must be an identifier: a letter or _ then letters, digits, _ or $, \
             at most {MAX_IDENTIFIER_LEN} bytes"
        ));
    }
    Ok(())
}

fn port_ok(authority: &str) -> bool {
    // Bracketed IPv6 literal: the port (if any) follows the closing bracket.
    let after_host = match authority.strip_prefix('[') {
        Some(v6) => match v6.split_once(']') {
            Some((_, tail)) => tail,
            None => return false,
        },
        None => match authority.split_once(':') {
            Some((_, port)) => return port.parse::<u16>().is_ok(),
            None => return true,
        },
    };
    match after_host.strip_prefix(':') {
        Some(port) => port.parse::<u16>().is_ok(),
        None => after_host.is_empty(),
    }
}

/// Conservative test used only when a DSN does not parse, so its text is
/// about to be echoed in an error: anything that might be a password makes
/// the message withhold the value entirely.
fn looks_like_it_has_password(dsn: &str) -> bool {
    if dsn.to_ascii_lowercase().contains("password") {
        return true;
    }
    // URL form: user:secret@host
    let after_scheme = dsn.split_once("://").map(|(_, r)| r).unwrap_or_default();
    let authority = after_scheme.split('/').next().unwrap_or_default();
    match authority.rsplit_once('@') {
        Some((userinfo, _)) => userinfo.contains(':'),
        None => false,
    }
}

pub(crate) fn to_agent_config(
    raw: RawConfig,
    origins: &EnvOrigins,
) -> Result<AgentConfig, ConfigError> {
    let c = Checker { origins };

    let node = NodeSection {
        name: c.node_name(raw.node.name)?,
        data_dir: c.path("node.data_dir", raw.node.data_dir)?,
    };

    let postgres = PostgresSection {
        dsn: c.dsn("postgres.dsn", raw.postgres.dsn)?,
        peer_dsn: c.dsn("postgres.peer_dsn", raw.postgres.peer_dsn)?,
        password_file: c.opt_path("postgres.password_file", raw.postgres.password_file)?,
    };

    let tls_cert = c.opt_path("api.tls_cert", raw.api.tls_cert)?;
    let tls_key = c.opt_path("api.tls_key", raw.api.tls_key)?;
    let tls_ca = c.opt_path("api.tls_ca", raw.api.tls_ca)?;
    match (&tls_cert, &tls_key) {
        (Some(_), None) => {
            return Err(ConfigError::Missing {
                key: "api.tls_key".into(),
            });
        }
        (None, Some(_)) => {
            return Err(ConfigError::Missing {
                key: "api.tls_cert".into(),
            });
        }
        _ => {}
    }
    let listen = c.listen(raw.api.listen)?;
    let api = ApiSection {
        listen,
        advertise: c.advertise(raw.api.advertise, listen, tls_cert.is_some())?,
        token_file: c.path("api.token_file", raw.api.token_file)?,
        tls_cert,
        tls_key,
        tls_ca,
    };

    let replication = ReplicationSection {
        schemas: c.schemas(raw.replication.schemas)?,
        synchronous_commit: c.sync_commit(raw.replication.synchronous_commit)?,
        apply_lanes: c.int_in(
            "replication.apply_lanes",
            raw.replication.apply_lanes,
            (1, 64, 1),
        )?,
        group_transactions: c.int_in(
            "replication.group_transactions",
            raw.replication.group_transactions,
            (1, 1000, 1),
        )?,
    };

    let resolver = c.resolver(
        "conflicts.resolver",
        raw.conflicts
            .resolver
            .unwrap_or_else(|| ResolverSpec::LastWriterWins.to_string()),
    )?;
    let mut tables = std::collections::BTreeMap::new();
    for (table, resolver) in raw.conflicts.tables {
        let key = format!("conflicts.tables.\"{table}\"");
        let Some((schema, name)) = table.split_once('.') else {
            return Err(c.invalid(&key, &table, "table keys must be \"schema.table\""));
        };
        if let Err(reason) = identifier(schema).and_then(|()| identifier(name)) {
            return Err(c.invalid(
                &key,
                &table,
                format!("table keys must be \"schema.table\"; {reason}"),
            ));
        }
        if !replication.schemas.iter().any(|s| s == schema) {
            return Err(c.invalid(
                &key,
                &table,
                "names a table outside replication.schemas, so it would never see a conflict",
            ));
        }
        let resolver = c.resolver(&key, resolver)?;
        tables.insert(table, resolver);
    }

    Ok(AgentConfig {
        node,
        postgres,
        api,
        replication,
        conflicts: ConflictsSection { resolver, tables },
    })
}
