//! Errors of the replication client.
//!
//! Invariant: no variant ever carries the password. Server messages are the
//! server's text; our own messages are built from config fields other than
//! the password.

use std::io;

/// SQLSTATE of a wrong password (`invalid_password`).
pub const SQLSTATE_INVALID_PASSWORD: &str = "28P01";
/// SQLSTATE of a missing slot and other missing objects (`undefined_object`).
pub const SQLSTATE_UNDEFINED_OBJECT: &str = "42704";
/// SQLSTATE of CREATE_REPLICATION_SLOT on an existing slot (`duplicate_object`).
pub const SQLSTATE_DUPLICATE_OBJECT: &str = "42710";
/// SQLSTATE when a slot is in use by another walsender (`object_in_use`).
pub const SQLSTATE_OBJECT_IN_USE: &str = "55006";

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// An ErrorResponse from the server. `severity` is the non-localized one
    /// (ERROR, FATAL, PANIC) when the server sends it.
    #[error("{severity}: {message} (SQLSTATE {code}){}", fmt_detail(detail))]
    Server {
        severity: String,
        code: String,
        message: String,
        detail: Option<String>,
    },
    #[error("I/O error {context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    /// Authentication we cannot perform (method unsupported, no password
    /// configured). A wrong password is a [`ClientError::Server`] 28P01.
    #[error("authentication failed: {0}")]
    Auth(String),
    /// The server sent something the protocol does not allow at this point.
    #[error("protocol violation: {0}")]
    Protocol(String),
    #[error("TLS: {0}")]
    Tls(String),
    /// A bad connection string or option; names the offending key.
    #[error("invalid replication connection config: {0}")]
    Config(String),
}

fn fmt_detail(detail: &Option<String>) -> String {
    match detail {
        Some(d) => format!(" DETAIL: {d}"),
        None => String::new(),
    }
}

impl ClientError {
    /// The SQLSTATE of a server error, if this is one.
    pub fn code(&self) -> Option<&str> {
        match self {
            ClientError::Server { code, .. } => Some(code),
            _ => None,
        }
    }

    /// True when the connection is unusable afterwards (anything but an
    /// ordinary ERROR, which leaves the session idle and reusable).
    pub fn is_fatal(&self) -> bool {
        match self {
            ClientError::Server { severity, .. } => severity != "ERROR",
            _ => true,
        }
    }

    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> ClientError {
        ClientError::Io {
            context: context.into(),
            source,
        }
    }

    pub(crate) fn protocol(msg: impl Into<String>) -> ClientError {
        ClientError::Protocol(msg.into())
    }
}

impl From<crate::walsender::WalSenderError> for ClientError {
    fn from(e: crate::walsender::WalSenderError) -> Self {
        ClientError::Protocol(e.to_string())
    }
}
