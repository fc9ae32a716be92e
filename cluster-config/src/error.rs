use std::path::PathBuf;

/// Everything that can go wrong loading the agent configuration.
///
/// Every variant about a key carries its dotted path (`node.name`) and where
/// the value came from, so an operator can fix it without reading code.
/// Invariant: no variant ever holds a secret (a password or token) — DSNs are
/// redacted before they are stored here, and secret files are named, never
/// quoted.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file is missing, unreadable or not valid TOML.
    #[error("cannot load configuration: {message}")]
    Load { message: String },

    /// A key the agent does not know, usually a typo.
    #[error("unknown configuration key `{key}`{origin}")]
    UnknownKey { key: String, origin: Origin },

    /// A required key is absent.
    #[error("missing required configuration key `{key}`")]
    Missing { key: String },

    /// The value has the wrong TOML type (e.g. a string where a list belongs).
    #[error("wrong type for configuration key `{key}`{origin}: {message}")]
    WrongType {
        key: String,
        origin: Origin,
        message: String,
    },

    /// The value has the right type but is not acceptable.
    #[error("invalid value {value:?} for configuration key `{key}`{origin}: {reason}")]
    Invalid {
        key: String,
        value: String,
        reason: String,
        origin: Origin,
    },

    /// A DSN carries a password. Deliberately has no value field.
    #[error(
        "configuration key `{key}`{origin} contains an inline password; \
         remove it and put the password in the file named by `postgres.password_file`"
    )]
    InlinePassword { key: String, origin: Origin },

    /// An `MM_*` environment variable that cannot be mapped onto a key.
    #[error("environment variable {var}: {reason}")]
    Env { var: String, reason: String },

    /// A secret file could not be read or is empty. Names the file only.
    #[error("cannot read secret file {}: {reason}", path.display())]
    Secret { path: PathBuf, reason: String },
}

/// Where a configuration value came from, rendered as a suffix of messages.
///
/// Kept separate from the message so the same value can be compared in tests
/// and so file- and environment-sourced errors read alike.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Origin {
    /// From the TOML file (or string), or a built-in default.
    #[default]
    File,
    /// From an `MM_<SECTION>__<KEY>` environment variable.
    Env(String),
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::File => Ok(()),
            Origin::Env(var) => write!(f, " (set by environment variable {var})"),
        }
    }
}
