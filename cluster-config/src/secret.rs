use std::path::Path;

use crate::error::ConfigError;

/// Reads a secret (API token, PostgreSQL password) from its file.
///
/// Secrets live in files rather than in the config so the config can be
/// logged, shown and kept in version control. Surrounding whitespace is
/// dropped because editors and `echo` add a trailing newline that would
/// otherwise silently become part of the password. An empty secret is an
/// error: an empty cluster token would authenticate anyone. Errors name the
/// file and never include its content.
pub fn read_secret(path: impl AsRef<Path>) -> Result<String, ConfigError> {
    let path = path.as_ref();
    let content = std::fs::read(path).map_err(|e| ConfigError::Secret {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    let content = String::from_utf8(content).map_err(|_| ConfigError::Secret {
        path: path.to_owned(),
        reason: "not valid UTF-8".into(),
    })?;
    let trimmed = content.trim();
    if trimmed.is_empty() {
        return Err(ConfigError::Secret {
            path: path.to_owned(),
            reason: "the file is empty".into(),
        });
    }
    Ok(trimmed.to_owned())
}
