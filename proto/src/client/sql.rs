//! The same connection string and TLS rules for ordinary SQL connections
//! through tokio-postgres.
//!
//! tokio-postgres' own parser rejects `sslmode=verify-ca|verify-full` and
//! `sslrootcert`, and it ships no TLS. Converting our parsed config keeps
//! one DSN per peer valid for both the replication stream and the SQL the
//! agent runs against that peer (initial copy, slot management), with the
//! same certificate checks.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::ClientError;
use super::config::{Host, ReplicationConfig, SslMode};
use super::tls;

/// A tokio-postgres TLS connector applying our sslmode/sslrootcert rules.
#[derive(Clone)]
pub struct RustlsConnect {
    config: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for RustlsConnect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RustlsConnect")
    }
}

impl ReplicationConfig {
    /// The equivalent tokio-postgres config (without `replication=database`)
    /// and the TLS connector to pass to `Config::connect`:
    ///
    /// ```no_run
    /// # async fn f(c: mm_proto::client::ReplicationConfig) -> Result<(), Box<dyn std::error::Error>> {
    /// let (sql_config, tls) = c.to_sql_config()?;
    /// let (client, connection) = sql_config.connect(tls).await?;
    /// tokio::spawn(connection);
    /// # Ok(()) }
    /// ```
    ///
    /// Extra startup parameters travel as `-c name=value` in `options`
    /// (tokio-postgres sends no others); `client_encoding` is left out
    /// because tokio-postgres always uses UTF8.
    pub fn to_sql_config(&self) -> Result<(tokio_postgres::Config, RustlsConnect), ClientError> {
        self.validate()?;
        let mut c = tokio_postgres::Config::new();
        for target in self.targets()? {
            match &target.host {
                Host::Tcp(h) => c.host(h),
                Host::Unix(p) => c.host_path(p),
            };
            c.port(target.port);
        }
        if self.hostaddrs.iter().all(Option::is_some) {
            for addr in self.hostaddrs.iter().flatten() {
                c.hostaddr(*addr);
            }
        } else {
            return Err(ClientError::Config(
                "empty hostaddr entries cannot be passed to SQL connections".into(),
            ));
        }
        if let Some(user) = self.user() {
            c.user(user);
        }
        if let Some(password) = &self.password {
            c.password(password.as_bytes());
        }
        if let Some(db) = self.dbname() {
            c.dbname(db);
        }
        if let Some(app) = self.application_name() {
            c.application_name(app);
        }
        let mut options: Vec<String> = self.options.iter().cloned().collect();
        options.extend(
            self.params
                .iter()
                .filter(|(k, _)| k != "client_encoding")
                .map(|(k, v)| format!("-c {}={}", escape_option(k), escape_option(v))),
        );
        if !options.is_empty() {
            c.options(options.join(" "));
        }
        if let Some(t) = self.connect_timeout {
            c.connect_timeout(t);
        }
        // Verification happens in our rustls config; tokio-postgres only
        // needs to know whether plain text is acceptable. Like libpq (and
        // the replication client), sslmode does not apply to Unix sockets;
        // tokio-postgres would insist, so only-socket configs disable it.
        let all_unix = c
            .get_hosts()
            .iter()
            .all(|h| matches!(h, tokio_postgres::config::Host::Unix(_)));
        c.ssl_mode(match self.ssl_mode {
            _ if all_unix => tokio_postgres::config::SslMode::Disable,
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Allow | SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
                tokio_postgres::config::SslMode::Require
            }
        });
        let tls = RustlsConnect {
            config: tls::client_config(self)?,
        };
        Ok((c, tls))
    }
}

/// Backslash-escapes whitespace and backslashes, as the server's
/// `options` splitter (pg_split_opts) expects; an empty value needs no
/// escaping because `-c name=` already means the empty string.
fn escape_option(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for ch in s.chars() {
        if ch.is_whitespace() || ch == '\\' {
            out.push('\\');
        }
        out.push(ch);
    }
    out
}

impl<S> tokio_postgres::tls::MakeTlsConnect<S> for RustlsConnect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type TlsConnect = RustlsConnectOne;
    type Error = ClientError;

    /// tokio-postgres asks for a connector before it knows whether TLS will
    /// be used, with "" for Unix sockets, so an unusable name only fails
    /// once a handshake is actually attempted.
    fn make_tls_connect(&mut self, domain: &str) -> Result<RustlsConnectOne, ClientError> {
        Ok(RustlsConnectOne {
            config: self.config.clone(),
            name: tls::server_name(domain),
        })
    }
}

/// One pending handshake, for one host.
pub struct RustlsConnectOne {
    config: Arc<rustls::ClientConfig>,
    name: Result<rustls::pki_types::ServerName<'static>, ClientError>,
}

impl<S> tokio_postgres::tls::TlsConnect<S> for RustlsConnectOne
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type Error = ClientError;
    type Future = Pin<Box<dyn Future<Output = Result<RustlsStream<S>, ClientError>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        Box::pin(async move {
            tokio_rustls::TlsConnector::from(self.config)
                .connect(self.name?, stream)
                .await
                .map(|s| RustlsStream(Box::new(s)))
                .map_err(|e| ClientError::Tls(format!("handshake: {e}")))
        })
    }
}

/// A TLS session under a tokio-postgres connection.
pub struct RustlsStream<S>(Box<tokio_rustls::client::TlsStream<S>>);

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for RustlsStream<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for RustlsStream<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut *self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> tokio_postgres::tls::TlsStream for RustlsStream<S> {
    /// No channel binding, as in the replication client: SCRAM then runs
    /// without it (tokio-postgres picks plain SCRAM-SHA-256).
    fn channel_binding(&self) -> tokio_postgres::tls::ChannelBinding {
        tokio_postgres::tls::ChannelBinding::none()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn converts_fields() {
        let rc = ReplicationConfig::from_dsn(
            "host=a,/sock port=1,2 user=u password=pw dbname=d application_name=app options='-c work_mem=4MB' sslmode=verify-ca sslrootcert=/nonexistent connect_timeout=5",
        )
        .unwrap()
        .with_param("search_path", "")
        .with_param("timezone", "America/New York");
        // The CA file is read when building the connector.
        assert!(matches!(rc.to_sql_config(), Err(ClientError::Tls(_))));
        let rc = rc.with_ssl_mode(SslMode::Require);
        let rc = ReplicationConfig {
            ssl_root_cert: None,
            ..rc
        };
        let (c, _tls) = rc.to_sql_config().unwrap();
        assert_eq!(
            c.get_hosts(),
            &[
                tokio_postgres::config::Host::Tcp("a".into()),
                tokio_postgres::config::Host::Unix("/sock".into())
            ]
        );
        assert_eq!(c.get_ports(), &[1, 2]);
        assert_eq!(c.get_user(), Some("u"));
        assert_eq!(c.get_password(), Some(&b"pw"[..]));
        assert_eq!(c.get_dbname(), Some("d"));
        assert_eq!(c.get_application_name(), Some("app"));
        assert_eq!(
            c.get_options(),
            Some("-c work_mem=4MB -c search_path= -c timezone=America/New\\ York")
        );
        assert_eq!(c.get_ssl_mode(), tokio_postgres::config::SslMode::Require);
        assert_eq!(
            c.get_connect_timeout(),
            Some(&std::time::Duration::from_secs(5))
        );
    }
}
