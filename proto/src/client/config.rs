//! Connection settings for a replication connection, parsed from the same
//! connection strings libpq accepts (`key=value ...` and `postgresql://` URLs).
//!
//! Our own parser rather than `tokio_postgres::Config`: that one rejects
//! `sslmode=verify-ca|verify-full` and `sslrootcert`, which operators need to
//! authenticate the peer a replication stream trusts with every row.
//! Options we cannot honour are errors naming the option, never silently
//! dropped: a security option quietly ignored is worse than a refusal.

use std::fmt;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::ClientError;

pub const DEFAULT_PORT: u16 = 5432;
pub const DEFAULT_HOST: &str = "localhost";

/// libpq's `sslmode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SslMode {
    Disable,
    /// Treated like `Prefer` (TLS tried first); libpq tries plain first, but
    /// both accept either outcome.
    Allow,
    /// TLS if the server offers it, otherwise plain. Certificates are not
    /// verified unless `sslrootcert` is set (then like `VerifyCa`).
    #[default]
    Prefer,
    /// TLS or fail. Without `sslrootcert` any server certificate is accepted:
    /// encryption without authentication, exactly libpq's `require`. With
    /// `sslrootcert` the chain is verified (libpq does the same).
    Require,
    /// TLS with the chain verified against `sslrootcert`; the host name is not checked.
    VerifyCa,
    /// TLS with the chain verified against `sslrootcert` and the host name checked.
    VerifyFull,
}

impl SslMode {
    fn parse(v: &str) -> Result<SslMode, ClientError> {
        Ok(match v {
            "disable" => SslMode::Disable,
            "allow" => SslMode::Allow,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => return Err(bad_value("sslmode", other)),
        })
    }

    /// Whether the connection must fail rather than continue unencrypted.
    pub fn requires_tls(self) -> bool {
        matches!(
            self,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull
        )
    }
}

/// Where to connect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Host {
    /// A host name or IP address.
    Tcp(String),
    /// A directory holding the server's socket `.s.PGSQL.<port>`.
    Unix(PathBuf),
}

/// Minimum TLS version (`ssl_min_protocol_version`); rustls never goes below 1.2.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TlsVersion {
    #[default]
    Tls12,
    Tls13,
}

/// Everything needed to open a replication connection.
///
/// Invariant: the password is only ever written to the wire during
/// authentication; `Debug` redacts it and no error message includes it.
#[derive(Clone, Default)]
pub struct ReplicationConfig {
    pub(crate) hosts: Vec<Host>,
    pub(crate) hostaddrs: Vec<Option<IpAddr>>,
    pub(crate) ports: Vec<u16>,
    pub(crate) user: Option<String>,
    pub(crate) password: Option<String>,
    pub(crate) dbname: Option<String>,
    pub(crate) application_name: Option<String>,
    pub(crate) fallback_application_name: Option<String>,
    pub(crate) options: Option<String>,
    pub(crate) ssl_mode: SslMode,
    pub(crate) ssl_root_cert: Option<PathBuf>,
    pub(crate) ssl_min_version: TlsVersion,
    pub(crate) connect_timeout: Option<Duration>,
    /// Extra startup parameters (GUCs), in order, keys unique.
    pub(crate) params: Vec<(String, String)>,
}

impl fmt::Debug for ReplicationConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReplicationConfig")
            .field("hosts", &self.hosts)
            .field("hostaddrs", &self.hostaddrs)
            .field("ports", &self.ports)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("dbname", &self.dbname)
            .field("application_name", &self.application_name)
            .field("options", &self.options)
            .field("ssl_mode", &self.ssl_mode)
            .field("ssl_root_cert", &self.ssl_root_cert)
            .field("ssl_min_version", &self.ssl_min_version)
            .field("connect_timeout", &self.connect_timeout)
            .field("params", &self.params)
            .finish()
    }
}

/// One place to try, in order: `connect` walks these until one succeeds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Target {
    pub host: Host,
    pub hostaddr: Option<IpAddr>,
    pub port: u16,
}

impl ReplicationConfig {
    /// An empty config: localhost:5432, sslmode=prefer, no user yet.
    pub fn new() -> ReplicationConfig {
        ReplicationConfig::default()
    }

    /// Parses a libpq connection string: `host=/run/postgresql port=5432
    /// user=mm dbname=app` or `postgresql://mm:pw@h1:5432,h2/app?sslmode=require`.
    ///
    /// Environment variables (PGHOST, ...) and service files are not consulted:
    /// the agent's configuration is the single source of truth.
    pub fn from_dsn(dsn: &str) -> Result<ReplicationConfig, ClientError> {
        let mut config = ReplicationConfig::new();
        let trimmed = dsn.trim_start();
        if let Some(rest) = trimmed
            .strip_prefix("postgresql://")
            .or_else(|| trimmed.strip_prefix("postgres://"))
        {
            parse_url(rest, &mut config)?;
        } else {
            for (key, value) in parse_keyword_value(dsn)? {
                config.set(&key, &value)?;
            }
        }
        config.validate()?;
        Ok(config)
    }

    /// Sets one libpq connection option by keyword, as in a connection string.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), ClientError> {
        match key {
            "host" => {
                self.hosts = split_list(value)
                    .map(|h| {
                        if h.is_empty() {
                            Host::Tcp(DEFAULT_HOST.to_owned())
                        } else if h.starts_with('/') {
                            Host::Unix(PathBuf::from(h))
                        } else {
                            Host::Tcp(h.to_owned())
                        }
                    })
                    .collect()
            }
            "hostaddr" => {
                self.hostaddrs = split_list(value)
                    .map(|a| {
                        if a.is_empty() {
                            Ok(None)
                        } else {
                            a.parse().map(Some).map_err(|_| bad_value("hostaddr", a))
                        }
                    })
                    .collect::<Result<_, _>>()?
            }
            "port" => {
                self.ports = split_list(value)
                    .map(|p| {
                        if p.is_empty() {
                            Ok(DEFAULT_PORT)
                        } else {
                            p.parse::<u16>()
                                .ok()
                                .filter(|p| *p != 0)
                                .ok_or_else(|| bad_value("port", p))
                        }
                    })
                    .collect::<Result<_, _>>()?
            }
            "user" => self.user = non_empty(value),
            "password" => self.password = Some(value.to_owned()),
            "dbname" => self.dbname = non_empty(value),
            "application_name" => self.application_name = Some(value.to_owned()),
            "fallback_application_name" => self.fallback_application_name = Some(value.to_owned()),
            "options" => self.options = non_empty(value),
            "client_encoding" => self.upsert_param("client_encoding", value),
            "sslmode" => self.ssl_mode = SslMode::parse(value)?,
            "sslrootcert" => {
                if value == "system" {
                    return Err(unsupported(key, "sslrootcert=system; give a CA file"));
                }
                self.ssl_root_cert = non_empty(value).map(PathBuf::from)
            }
            "ssl_min_protocol_version" => {
                self.ssl_min_version = match value {
                    "" | "TLSv1" | "TLSv1.1" | "TLSv1.2" => TlsVersion::Tls12,
                    "TLSv1.3" => TlsVersion::Tls13,
                    other => return Err(bad_value(key, other)),
                }
            }
            "connect_timeout" => {
                let secs: i64 = value.trim().parse().map_err(|_| bad_value(key, value))?;
                // libpq: zero or negative waits forever, and 1 is raised to 2
                // because a one-second timeout fires spuriously.
                self.connect_timeout = match u64::try_from(secs) {
                    Ok(0) | Err(_) => None,
                    Ok(s) => Some(Duration::from_secs(s.max(2))),
                };
            }
            "replication" => {
                if value != "database" {
                    return Err(unsupported(
                        key,
                        "replication connections here are always replication=database",
                    ));
                }
            }
            "gssencmode" => match value {
                "disable" | "prefer" | "allow" => {}
                other => return Err(unsupported(key, &format!("gssencmode={other}"))),
            },
            "channel_binding" => match value {
                "disable" | "prefer" => {}
                other => return Err(unsupported(key, &format!("channel_binding={other}"))),
            },
            "sslnegotiation" => match value {
                "postgres" => {}
                other => return Err(unsupported(key, &format!("sslnegotiation={other}"))),
            },
            "target_session_attrs" => match value {
                "any" => {}
                other => return Err(unsupported(key, &format!("target_session_attrs={other}"))),
            },
            "load_balance_hosts" => match value {
                "disable" => {}
                other => return Err(unsupported(key, &format!("load_balance_hosts={other}"))),
            },
            // Transport tuning with no effect on correctness or security: the
            // stream detects dead peers through walsender keepalives instead.
            "keepalives"
            | "keepalives_idle"
            | "keepalives_interval"
            | "keepalives_count"
            | "tcp_user_timeout"
            | "sslcompression"
            | "sslsni"
            | "krbsrvname"
            | "gsslib" => {}
            "sslcert"
            | "sslkey"
            | "sslpassword"
            | "sslcrl"
            | "sslcrldir"
            | "sslcertmode"
            | "passfile"
            | "service"
            | "requirepeer"
            | "require_auth"
            | "gssdelegation"
            | "ssl_max_protocol_version"
            | "min_protocol_version"
            | "max_protocol_version" => {
                return Err(unsupported(key, "this option"));
            }
            other => {
                return Err(ClientError::Config(format!(
                    "unknown connection option {other:?}"
                )));
            }
        }
        Ok(())
    }

    /// Sets the password programmatically (e.g. read from a password file),
    /// overriding any in the connection string.
    pub fn with_password(mut self, password: impl Into<String>) -> Self {
        self.password = Some(password.into());
        self
    }

    /// Adds a startup parameter (a GUC for the walsender session, e.g.
    /// `datestyle=ISO`), replacing an earlier value of the same name. `user`,
    /// `database`, `options` and `application_name` set those fields;
    /// `replication` cannot be changed (always `database`).
    pub fn with_param(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        let name = name.into();
        let value = value.into();
        match name.as_str() {
            "user" => self.user = Some(value),
            "database" => self.dbname = Some(value),
            "options" => self.options = Some(value),
            "application_name" => self.application_name = Some(value),
            "replication" => {}
            _ => self.upsert_param(&name, &value),
        }
        self
    }

    /// The session settings PostgreSQL's own walreceiver forces, so that the
    /// text form of values means the same on both ends whatever the
    /// database or role defaults say (ISO dates, UTC, round-trip floats, and
    /// an empty search_path so nothing resolves through user schemas).
    pub fn with_portable_text_settings(self) -> Self {
        self.with_param("datestyle", "ISO")
            .with_param("intervalstyle", "postgres")
            .with_param("extra_float_digits", "3")
            .with_param("timezone", "UTC")
            .with_param("search_path", "")
    }

    pub fn with_user(mut self, user: impl Into<String>) -> Self {
        self.user = Some(user.into());
        self
    }

    pub fn with_dbname(mut self, dbname: impl Into<String>) -> Self {
        self.dbname = Some(dbname.into());
        self
    }

    pub fn with_host(mut self, host: Host) -> Self {
        self.hosts = vec![host];
        self.hostaddrs.clear();
        self
    }

    pub fn with_port(mut self, port: u16) -> Self {
        self.ports = vec![port];
        self
    }

    pub fn with_application_name(mut self, name: impl Into<String>) -> Self {
        self.application_name = Some(name.into());
        self
    }

    pub fn with_ssl_mode(mut self, mode: SslMode) -> Self {
        self.ssl_mode = mode;
        self
    }

    pub fn with_ssl_root_cert(mut self, path: impl Into<PathBuf>) -> Self {
        self.ssl_root_cert = Some(path.into());
        self
    }

    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = Some(timeout);
        self
    }

    pub fn hosts(&self) -> &[Host] {
        &self.hosts
    }

    pub fn ports(&self) -> &[u16] {
        &self.ports
    }

    pub fn user(&self) -> Option<&str> {
        self.user.as_deref()
    }

    pub fn has_password(&self) -> bool {
        self.password.is_some()
    }

    /// The database; libpq defaults it to the user name.
    pub fn dbname(&self) -> Option<&str> {
        self.dbname.as_deref().or(self.user.as_deref())
    }

    pub fn application_name(&self) -> Option<&str> {
        self.application_name
            .as_deref()
            .or(self.fallback_application_name.as_deref())
    }

    pub fn ssl_mode(&self) -> SslMode {
        self.ssl_mode
    }

    pub fn ssl_root_cert(&self) -> Option<&std::path::Path> {
        self.ssl_root_cert.as_deref()
    }

    pub fn connect_timeout(&self) -> Option<Duration> {
        self.connect_timeout
    }

    /// Extra startup parameters in the order they will be sent.
    pub fn params(&self) -> &[(String, String)] {
        &self.params
    }

    fn upsert_param(&mut self, name: &str, value: &str) {
        match self.params.iter_mut().find(|(k, _)| k == name) {
            Some(slot) => slot.1 = value.to_owned(),
            None => self.params.push((name.to_owned(), value.to_owned())),
        }
    }

    /// Checks what only makes sense for the whole config (list lengths,
    /// modes that need a CA file).
    pub(crate) fn validate(&self) -> Result<(), ClientError> {
        self.targets().map(|_| ())?;
        if matches!(self.ssl_mode, SslMode::VerifyCa | SslMode::VerifyFull)
            && self.ssl_root_cert.is_none()
        {
            return Err(ClientError::Config(
                "sslmode=verify-ca/verify-full needs sslrootcert (a CA file)".into(),
            ));
        }
        Ok(())
    }

    /// The (host, hostaddr, port) triples to try, in order, with libpq's
    /// rules: one port applies to every host, otherwise the counts must match.
    pub(crate) fn targets(&self) -> Result<Vec<Target>, ClientError> {
        let mut hosts = self.hosts.clone();
        if hosts.is_empty() {
            // hostaddr without host: connect to the address, name it by itself.
            hosts = if self.hostaddrs.is_empty() {
                vec![Host::Tcp(DEFAULT_HOST.to_owned())]
            } else {
                self.hostaddrs
                    .iter()
                    .map(|a| {
                        Host::Tcp(a.map_or_else(|| DEFAULT_HOST.to_owned(), |a| a.to_string()))
                    })
                    .collect()
            };
        }
        if !self.hostaddrs.is_empty() && self.hostaddrs.len() != hosts.len() {
            return Err(ClientError::Config(format!(
                "{} hostaddr values for {} hosts",
                self.hostaddrs.len(),
                hosts.len()
            )));
        }
        let ports: Vec<u16> = match self.ports.len() {
            0 => vec![DEFAULT_PORT; hosts.len()],
            1 => vec![self.ports[0]; hosts.len()],
            n if n == hosts.len() => self.ports.clone(),
            n => {
                return Err(ClientError::Config(format!(
                    "{n} port values for {} hosts",
                    hosts.len()
                )));
            }
        };
        Ok(hosts
            .into_iter()
            .zip(ports)
            .enumerate()
            .map(|(i, (host, port))| Target {
                host,
                hostaddr: self.hostaddrs.get(i).copied().flatten(),
                port,
            })
            .collect())
    }
}

impl std::str::FromStr for ReplicationConfig {
    type Err = ClientError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ReplicationConfig::from_dsn(s)
    }
}

fn bad_value(key: &str, value: &str) -> ClientError {
    ClientError::Config(format!("invalid value {value:?} for {key}"))
}

fn unsupported(key: &str, what: &str) -> ClientError {
    ClientError::Config(format!(
        "{key}: {what} is not supported by the replication client"
    ))
}

fn non_empty(v: &str) -> Option<String> {
    (!v.is_empty()).then(|| v.to_owned())
}

fn split_list(v: &str) -> impl Iterator<Item = &str> {
    v.split(',').map(str::trim)
}

/// libpq's `keyword = value` syntax: values may be single-quoted; inside or
/// outside quotes a backslash escapes the next character.
fn parse_keyword_value(s: &str) -> Result<Vec<(String, String)>, ClientError> {
    let mut out = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            return Ok(out);
        }
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next() != Some('=') {
            return Err(ClientError::Config(format!(
                "missing \"=\" after {key:?} in connection string"
            )));
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if_eq(&'\'').is_some() {
            loop {
                match chars.next() {
                    None => {
                        return Err(ClientError::Config(format!(
                            "unterminated quoted value for {key:?} in connection string"
                        )));
                    }
                    Some('\'') => break,
                    Some('\\') => {
                        if let Some(c) = chars.next() {
                            value.push(c);
                        }
                    }
                    Some(c) => value.push(c),
                }
            }
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                if c == '\\' {
                    if let Some(c) = chars.next() {
                        value.push(c);
                    }
                } else {
                    value.push(c);
                }
            }
        }
        out.push((key, value));
    }
}

/// `[user[:password]@][host[:port][,...]][/dbname][?key=value&...]`, the part
/// after the scheme, with percent-decoding of every component.
fn parse_url(rest: &str, config: &mut ReplicationConfig) -> Result<(), ClientError> {
    let (before_query, query) = match rest.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (rest, None),
    };
    let (authority, dbname) = match before_query.split_once('/') {
        Some((a, d)) => (a, Some(d)),
        None => (before_query, None),
    };
    // The password may itself contain '@' when percent-encoding was skipped:
    // the last '@' separates the user part, as in libpq.
    let hostspec = match authority.rsplit_once('@') {
        Some((userinfo, hostspec)) => {
            match userinfo.split_once(':') {
                Some((user, password)) => {
                    config.set("user", &percent_decode(user, "user")?)?;
                    config.set("password", &percent_decode(password, "password")?)?;
                }
                None => config.set("user", &percent_decode(userinfo, "user")?)?,
            }
            hostspec
        }
        None => authority,
    };
    if !hostspec.is_empty() {
        let mut hosts = Vec::new();
        let mut ports = Vec::new();
        for part in hostspec.split(',') {
            let (host, port) = split_host_port(part)?;
            hosts.push(percent_decode(host, "host")?);
            ports.push(port.to_owned());
        }
        // Every host must be representable in the comma list we feed to `set`.
        if hosts.iter().any(|h| h.contains(',')) {
            return Err(bad_value("host", "a host name containing ','"));
        }
        config.set("host", &hosts.join(","))?;
        if ports.iter().any(|p| !p.is_empty()) {
            config.set("port", &ports.join(","))?;
        }
    }
    if let Some(db) = dbname.filter(|d| !d.is_empty()) {
        config.set("dbname", &percent_decode(db, "dbname")?)?;
    }
    if let Some(query) = query {
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').ok_or_else(|| {
                ClientError::Config(format!("missing \"=\" in URL parameter {pair:?}"))
            })?;
            let k = percent_decode(k, "parameter name")?;
            let v = percent_decode(v, &k)?;
            config.set(&k, &v)?;
        }
    }
    Ok(())
}

/// Splits `host[:port]`, where host may be a bracketed IPv6 literal.
fn split_host_port(part: &str) -> Result<(&str, &str), ClientError> {
    if let Some(inner) = part.strip_prefix('[') {
        let (host, after) = inner
            .split_once(']')
            .ok_or_else(|| bad_value("host", part))?;
        let port = match after {
            "" => "",
            p => p.strip_prefix(':').ok_or_else(|| bad_value("host", part))?,
        };
        return Ok((host, port));
    }
    Ok(match part.rsplit_once(':') {
        Some((h, p)) => (h, p),
        None => (part, ""),
    })
}

fn percent_decode(s: &str, what: &str) -> Result<String, ClientError> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| {
                    ClientError::Config(format!("invalid percent-encoding in URL {what}"))
                })?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out)
        .map_err(|_| ClientError::Config(format!("URL {what} is not UTF-8 after percent-decoding")))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn t(host: Host, port: u16) -> Target {
        Target {
            host,
            hostaddr: None,
            port,
        }
    }

    #[test]
    fn keyword_value() {
        let c = ReplicationConfig::from_dsn(
            "host=/run/postgresql port=5433 user=mm dbname=app application_name='my app' password='it\\'s'",
        )
        .unwrap();
        assert_eq!(
            c.targets().unwrap(),
            vec![t(Host::Unix("/run/postgresql".into()), 5433)]
        );
        assert_eq!(c.user(), Some("mm"));
        assert_eq!(c.dbname(), Some("app"));
        assert_eq!(c.application_name(), Some("my app"));
        assert_eq!(c.password.as_deref(), Some("it's"));
        assert_eq!(c.ssl_mode(), SslMode::Prefer);
    }

    #[test]
    fn spaces_around_equals_and_multi_host() {
        let c = ReplicationConfig::from_dsn("  host = a,b  port=1,2 user = u sslmode=disable ")
            .unwrap();
        assert_eq!(
            c.targets().unwrap(),
            vec![t(Host::Tcp("a".into()), 1), t(Host::Tcp("b".into()), 2)]
        );
        assert_eq!(c.dbname(), Some("u"), "dbname defaults to user");
        assert_eq!(c.ssl_mode(), SslMode::Disable);
        assert!(ReplicationConfig::from_dsn("host=a,b,c port=1,2").is_err());
    }

    #[test]
    fn url_forms() {
        let c = ReplicationConfig::from_dsn(
            "postgresql://mm:p%40ss@h1:5433,[::1]:5434/app?sslmode=require&application_name=x%20y",
        )
        .unwrap();
        assert_eq!(
            c.targets().unwrap(),
            vec![
                t(Host::Tcp("h1".into()), 5433),
                t(Host::Tcp("::1".into()), 5434)
            ]
        );
        assert_eq!(c.password.as_deref(), Some("p@ss"));
        assert_eq!(c.dbname(), Some("app"));
        assert_eq!(c.ssl_mode(), SslMode::Require);
        assert_eq!(c.application_name(), Some("x y"));

        let c = ReplicationConfig::from_dsn("postgres://%2Ftmp%2Fpg:6000/db?user=me").unwrap();
        assert_eq!(
            c.targets().unwrap(),
            vec![t(Host::Unix("/tmp/pg".into()), 6000)]
        );
        assert_eq!(c.user(), Some("me"));

        let c = ReplicationConfig::from_dsn("postgresql://u@/db?host=/sock&port=7").unwrap();
        assert_eq!(c.targets().unwrap(), vec![t(Host::Unix("/sock".into()), 7)]);

        let c = ReplicationConfig::from_dsn("postgresql://").unwrap();
        assert_eq!(
            c.targets().unwrap(),
            vec![t(Host::Tcp("localhost".into()), 5432)]
        );
    }

    #[test]
    fn tls_options() {
        let c =
            ReplicationConfig::from_dsn("host=h sslmode=verify-full sslrootcert=/ca.pem").unwrap();
        assert_eq!(c.ssl_mode(), SslMode::VerifyFull);
        assert_eq!(c.ssl_root_cert(), Some(std::path::Path::new("/ca.pem")));
        let e = ReplicationConfig::from_dsn("host=h sslmode=verify-ca").unwrap_err();
        assert!(e.to_string().contains("sslrootcert"), "{e}");
        let e = ReplicationConfig::from_dsn("host=h sslmode=bogus").unwrap_err();
        assert!(e.to_string().contains("sslmode"), "{e}");
    }

    #[test]
    fn bad_input_names_the_key() {
        for (dsn, needle) in [
            ("host=h nosuch=1", "nosuch"),
            ("port=abc", "port"),
            ("port=0", "port"),
            ("host=h sslcert=/x", "sslcert"),
            ("host", "="),
            ("password='unterminated", "unterminated"),
            ("postgresql://h/db?x", "="),
            ("postgresql://h/%zz", "percent"),
            ("replication=true", "replication"),
            ("hostaddr=not-an-ip", "hostaddr"),
        ] {
            let e = ReplicationConfig::from_dsn(dsn).unwrap_err();
            assert!(matches!(e, ClientError::Config(_)), "{dsn}: {e:?}");
            assert!(e.to_string().contains(needle), "{dsn}: {e}");
        }
    }

    #[test]
    fn debug_and_errors_never_show_the_password() {
        let c = ReplicationConfig::from_dsn("host=h user=u password=hunter2").unwrap();
        let dbg = format!("{c:?}");
        assert!(!dbg.contains("hunter2"), "{dbg}");
        assert!(dbg.contains("<redacted>"));
        let e = ReplicationConfig::from_dsn("postgresql://u:hunter2@h/db?nosuch=1").unwrap_err();
        assert!(!format!("{e} {e:?}").contains("hunter2"));
        let c = ReplicationConfig::new().with_password("hunter3");
        assert!(!format!("{c:?}").contains("hunter3"));
    }

    #[test]
    fn params_replace_and_route() {
        let c = ReplicationConfig::from_dsn("host=h user=a client_encoding=LATIN1")
            .unwrap()
            .with_param("datestyle", "ISO")
            .with_param("datestyle", "SQL")
            .with_param("user", "b")
            .with_param("replication", "true")
            .with_portable_text_settings();
        assert_eq!(c.user(), Some("b"));
        assert_eq!(
            c.params(),
            &[
                ("client_encoding".to_owned(), "LATIN1".to_owned()),
                ("datestyle".to_owned(), "ISO".to_owned()),
                ("intervalstyle".to_owned(), "postgres".to_owned()),
                ("extra_float_digits".to_owned(), "3".to_owned()),
                ("timezone".to_owned(), "UTC".to_owned()),
                ("search_path".to_owned(), String::new()),
            ]
        );
    }

    #[test]
    fn connect_timeout_follows_libpq() {
        let c = ReplicationConfig::from_dsn("connect_timeout=1").unwrap();
        assert_eq!(c.connect_timeout(), Some(Duration::from_secs(2)));
        let c = ReplicationConfig::from_dsn("connect_timeout=0").unwrap();
        assert_eq!(c.connect_timeout(), None);
        let c = ReplicationConfig::from_dsn("connect_timeout=10").unwrap();
        assert_eq!(c.connect_timeout(), Some(Duration::from_secs(10)));
    }

    #[test]
    fn hostaddr_pairs_with_host() {
        let c = ReplicationConfig::from_dsn("host=db.example hostaddr=10.0.0.1 port=5").unwrap();
        assert_eq!(
            c.targets().unwrap(),
            vec![Target {
                host: Host::Tcp("db.example".into()),
                hostaddr: Some("10.0.0.1".parse().unwrap()),
                port: 5
            }]
        );
        let c = ReplicationConfig::from_dsn("hostaddr=10.0.0.2").unwrap();
        assert_eq!(c.targets().unwrap()[0].host, Host::Tcp("10.0.0.2".into()));
    }
}
