//! The replicated tables on the new node before any row is copied: created
//! from the source's definitions when none exists (pg_dump of the
//! replicated schemas inside the copy's snapshot: tables, keys, indexes,
//! sequences, the types they use), compared when all exist.

use std::collections::BTreeSet;

use tokio_postgres::Client;

use super::SyncError;
use super::copy::{Table, columns};

/// What the new node has of the source's tables.
enum Fit {
    /// None of them: they are created from the source's definitions.
    Empty,
    /// All of them, alike and empty.
    Ready,
}

/// Refuses, naming every table and difference, unless the node has none of
/// the replicated tables or all of them with the source's columns and no
/// rows.
pub async fn check(local: &Client, tables: &[Table]) -> Result<(), SyncError> {
    fit(local, tables).await.map(|_| ())
}

async fn fit(local: &Client, tables: &[Table]) -> Result<Fit, SyncError> {
    let mut missing = Vec::new();
    let mut present = Vec::new();
    for t in tables {
        let oid: Option<u32> = local
            .query_one("SELECT pg_catalog.to_regclass($1)::oid", &[&t.sql])
            .await
            .map_err(|e| SyncError::Schema(e.to_string()))?
            .get(0);
        match oid {
            Some(oid) => present.push((t, oid)),
            None => missing.push(t.display.clone()),
        }
    }
    if present.is_empty() {
        return Ok(Fit::Empty);
    }
    if !missing.is_empty() {
        return Err(SyncError::Schema(format!(
            "this node has some of the replicated tables but lacks {}: create them like the \
             source's, or drop the others so they are all copied",
            missing.join(", ")
        )));
    }
    let mut problems = Vec::new();
    for (t, oid) in &present {
        let here = columns(local, *oid).await.map_err(SyncError::Schema)?;
        if here != t.columns {
            problems.push(format!(
                "{}: columns here {} but on the source {}",
                t.display,
                describe(&here),
                describe(&t.columns)
            ));
            continue;
        }
        let has_rows: bool = local
            .query_one(&format!("SELECT EXISTS (SELECT 1 FROM {})", t.sql), &[])
            .await
            .map_err(|e| SyncError::Schema(e.to_string()))?
            .get(0);
        if has_rows {
            problems.push(format!(
                "{}: holds rows on this node (add-node copies every row from the source: \
                 empty it first)",
                t.display
            ));
        }
    }
    if problems.is_empty() {
        Ok(Fit::Ready)
    } else {
        Err(SyncError::Schema(problems.join("; ")))
    }
}

/// True when the node has none of the tables (they are to be created);
/// refuses a node that has some, or different ones.
pub async fn needs_create(local: &Client, tables: &[Table]) -> Result<bool, SyncError> {
    Ok(!tables.is_empty() && matches!(fit(local, tables).await?, Fit::Empty))
}

/// The tables, without their indexes, keys and triggers (`post_data`,
/// after the rows, as pg_dump's own restore order has it).
pub async fn pre_data(
    local_dsn: (&str, Option<&str>),
    source: &Source<'_>,
    tables: &[Table],
) -> Result<(), SyncError> {
    restore(local_dsn, source, tables, "pre-data").await
}

/// Indexes, keys and triggers of the tables `prepare` created, then the
/// agent's own triggers.
pub async fn post_data(
    local_dsn: (&str, Option<&str>),
    source: &Source<'_>,
    tables: &[Table],
) -> Result<(), SyncError> {
    restore(local_dsn, source, tables, "post-data").await
}

/// Where pg_dump reads the definitions: the source inside the snapshot.
pub struct Source<'a> {
    pub dsn: &'a str,
    pub password: Option<&'a str>,
    pub snapshot: &'a str,
}

fn describe(cols: &[(String, String)]) -> String {
    let list: Vec<String> = cols.iter().map(|(n, t)| format!("{n} {t}")).collect();
    format!("({})", list.join(", "))
}

/// pg_dump beside the local server, else on PATH.
async fn pg_dump_path(local: &Client) -> String {
    let dir: Option<String> = local
        .query_opt(
            "SELECT setting FROM pg_catalog.pg_config WHERE name = 'BINDIR'",
            &[],
        )
        .await
        .ok()
        .flatten()
        .map(|r| r.get(0));
    match dir {
        Some(d) if std::path::Path::new(&d).join("pg_dump").exists() => {
            format!("{d}/pg_dump")
        }
        _ => "pg_dump".to_owned(),
    }
}

async fn restore(
    (local_dsn, local_password): (&str, Option<&str>),
    source: &Source<'_>,
    tables: &[Table],
    section: &str,
) -> Result<(), SyncError> {
    let schemas: BTreeSet<&str> = tables.iter().map(|t| t.schema.as_str()).collect();
    // A session of its own: the dump's SET commands stay in it. One
    // implicit transaction: all of the section or none of it.
    let local = &crate::pg::connect(local_dsn, local_password)
        .await
        .map_err(|e| SyncError::Schema(e.to_string()))?;
    let bin = pg_dump_path(local).await;
    let mut cmd = tokio::process::Command::new(&bin);
    cmd.args([
        "--schema-only",
        "--no-owner",
        "--no-privileges",
        "--no-publications",
        "--no-subscriptions",
        "--no-security-labels",
    ])
    .arg(format!("--snapshot={}", source.snapshot))
    .arg(format!("--section={section}"));
    for s in &schemas {
        cmd.arg(format!("--schema={s}"));
    }
    cmd.arg("--dbname").arg(source.dsn);
    if let Some(pw) = source.password {
        cmd.env("PGPASSWORD", pw);
    }
    cmd.stdin(std::process::Stdio::null());
    let out = cmd
        .output()
        .await
        .map_err(|e| SyncError::Schema(format!("running {bin}: {e}")))?;
    if !out.status.success() {
        return Err(SyncError::Schema(format!(
            "{bin} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    // Replica: the agent's event trigger stays out of the way (it would
    // add its triggers midway, e.g. before a partition is attached);
    // they are installed once the tables are complete.
    let sql = format!(
        "SET session_replication_role = replica;\n{}",
        filter_dump(&String::from_utf8_lossy(&out.stdout))
    );
    local.batch_execute(&sql).await.map_err(|e| {
        SyncError::Schema(format!(
            "creating the tables from the source's definitions ({section}): {}",
            match e.as_db_error() {
                Some(d) => d.message().to_owned(),
                None => e.to_string(),
            }
        ))
    })?;
    crate::schema::install_triggers(local)
        .await
        .map_err(|e| SyncError::Schema(e.to_string()))?;
    Ok(())
}

/// The dump without what is not SQL (psql meta-commands), without the
/// agent's own triggers (this node's agent installs its own), and with
/// schemas created only if missing.
fn filter_dump(dump: &str) -> String {
    let mut out = String::with_capacity(dump.len());
    for line in dump.lines() {
        if line.starts_with('\\') || line.starts_with("CREATE TRIGGER mm_") {
            continue;
        }
        if let Some(rest) = line.strip_prefix("CREATE SCHEMA ")
            && !rest.starts_with("IF NOT EXISTS")
        {
            out.push_str("CREATE SCHEMA IF NOT EXISTS ");
            out.push_str(rest);
            out.push('\n');
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::filter_dump;

    #[test]
    fn dumps_lose_meta_commands_and_agent_triggers_and_keep_the_rest() {
        let dump = "\\restrict abc\nSET x = 1;\nCREATE SCHEMA app;\n\
                    CREATE TABLE app.t (id int);\n\
                    CREATE TRIGGER mm_key_changes AFTER UPDATE OF id ON app.t FOR EACH ROW EXECUTE FUNCTION mm.f();\n\
                    CREATE TRIGGER audit AFTER INSERT ON app.t FOR EACH ROW EXECUTE FUNCTION app.a();\n\
                    \\unrestrict abc\n";
        assert_eq!(
            filter_dump(dump),
            "SET x = 1;\nCREATE SCHEMA IF NOT EXISTS app;\nCREATE TABLE app.t (id int);\n\
             CREATE TRIGGER audit AFTER INSERT ON app.t FOR EACH ROW EXECUTE FUNCTION app.a();\n"
        );
    }
}
