//! The rows of the copy: read from the source inside its exported snapshot
//! with each row's version, written on the new node one version at a time.
//!
//! A row's version is `pg_xact_commit_timestamp_origin(xmin)`: the origin
//! and commit timestamp of the transaction that wrote it. The new node's
//! conflict checks read the same thing from its own rows, so each group of
//! rows sharing a version is committed in a transaction of its own, under
//! that origin (`mm_<node>`, the node that wrote it) and with that commit
//! timestamp (`pg_replication_origin_xact_setup`): the copy is invisible to
//! last-writer-wins. Rows without a version are frozen, as on the source.
//!
//! Every statement built here names user objects only as quoted
//! identifiers, and reads the staging table through columns of our own
//! naming (`c0`, `c1`, ..., `o`, `t`), so no user name can capture ours.

use std::collections::HashMap;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt, pin_mut};
use tokio_postgres::Client;

use crate::apply::sql::quote_ident;
use crate::stream::names;

/// Versions (transactions) per round trip when writing the groups.
const GROUPS_PER_BATCH: usize = 200;

/// A replicated table of the source, as the copy sees it.
#[derive(Debug, Clone)]
pub struct Table {
    pub oid: u32,
    pub schema: String,
    /// Schema-qualified and quoted.
    pub sql: String,
    /// `schema.name`, for messages.
    pub display: String,
    /// Stored (not generated) columns: name and type (format_type).
    pub columns: Vec<(String, String)>,
}

fn pg_err(e: tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(d) => format!("{} ({})", d.message(), d.code().code()),
        None => e.to_string(),
    }
}

/// The tables of publication `mm` (partitioned ones as their root).
pub async fn published_tables(reader: &Client) -> Result<Vec<Table>, String> {
    let rows = reader
        .query(
            "SELECT c.oid, n.nspname::text, c.relname::text FROM pg_catalog.pg_publication_tables pt \
             JOIN pg_catalog.pg_namespace n ON n.nspname = pt.schemaname \
             JOIN pg_catalog.pg_class c ON c.relnamespace = n.oid AND c.relname = pt.tablename \
             WHERE pt.pubname = 'mm' ORDER BY 2, 3",
            &[],
        )
        .await
        .map_err(pg_err)?;
    let mut out = Vec::new();
    for r in rows {
        let oid: u32 = r.get(0);
        let schema: String = r.get(1);
        let name: String = r.get(2);
        let columns = columns(reader, oid).await?;
        out.push(Table {
            oid,
            sql: format!("{}.{}", quote_ident(&schema), quote_ident(&name)),
            display: format!("{schema}.{name}"),
            schema,
            columns,
        });
    }
    Ok(out)
}

/// Stored columns of a table, in order.
pub async fn columns(client: &Client, oid: u32) -> Result<Vec<(String, String)>, String> {
    let rows = client
        .query(
            "SELECT a.attname::text, pg_catalog.format_type(a.atttypid, a.atttypmod) \
             FROM pg_catalog.pg_attribute a WHERE a.attrelid = $1 AND a.attnum > 0 \
             AND NOT a.attisdropped AND a.attgenerated = '' ORDER BY a.attnum",
            &[&oid],
        )
        .await
        .map_err(pg_err)?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// The source's apply progress, (origin, LSN): inside the snapshot, exactly
/// the remote transactions the copy contains.
pub async fn source_progress(reader: &Client) -> Result<Vec<(String, String)>, String> {
    let rows = reader
        .query(
            "SELECT origin, remote_lsn::text FROM mm.apply_progress",
            &[],
        )
        .await
        .map_err(pg_err)?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// COPY out of the source into COPY in here; (rows, bytes). Rows are fed
/// without a flush each (the sink sends in large writes).
async fn pipe(
    out: tokio_postgres::CopyOutStream,
    sink: tokio_postgres::CopyInSink<bytes::Bytes>,
) -> Result<(u64, u64), String> {
    pin_mut!(out);
    pin_mut!(sink);
    let mut bytes = 0u64;
    while let Some(chunk) = out.next().await {
        let chunk = chunk.map_err(|e| format!("reading: {}", pg_err(e)))?;
        bytes += chunk.len() as u64;
        sink.feed(chunk).await.map_err(pg_err)?;
    }
    let rows = sink.as_mut().finish().await.map_err(pg_err)?;
    Ok((rows, bytes))
}

/// The version most rows of `table` share (the transaction that loaded
/// it, typically), for one straight COPY: (xmin, roident, commit
/// timestamp; None for rows without a known one). None for an empty table,
/// and when the COPY would have to come before rows that must be frozen
/// first (rows without a version, other than these).
async fn dominant_version(
    reader: &Client,
    table: &str,
) -> Result<Option<(String, Option<i64>, Option<String>)>, String> {
    // A sample is enough to find it (a full GROUP BY would cost a scan);
    // small tables may sample nothing: then the first row's.
    let mut top = reader
        .query_opt(
            &format!(
                "SELECT r.xmin::text FROM {table} AS r TABLESAMPLE SYSTEM (1) \
                 GROUP BY r.xmin ORDER BY count(*) DESC LIMIT 1"
            ),
            &[],
        )
        .await
        .map_err(pg_err)?;
    if top.is_none() {
        top = reader
            .query_opt(
                &format!("SELECT r.xmin::text FROM {table} AS r LIMIT 1"),
                &[],
            )
            .await
            .map_err(pg_err)?;
    }
    let Some(top) = top else {
        return Ok(None);
    };
    let xmin: String = top.get(0);
    let v = reader
        .query_one(
            "SELECT v.roident::int8, v.\"timestamp\"::text \
             FROM pg_catalog.pg_xact_commit_timestamp_origin($1::text::xid) AS v",
            &[&xmin],
        )
        .await
        .map_err(pg_err)?;
    let (roident, ts): (Option<i64>, Option<String>) = (v.get(0), v.get(1));
    if ts.is_some() {
        let unversioned = reader
            .query_opt(
                &format!(
                    "SELECT 1 FROM {table} AS r \
                     LEFT JOIN LATERAL pg_catalog.pg_xact_commit_timestamp_origin(r.xmin) AS v ON true \
                     WHERE NOT (r.xmin = $1::text::xid) AND v.\"timestamp\" IS NULL LIMIT 1"
                ),
                &[&xmin],
            )
            .await
            .map_err(pg_err)?;
        if unversioned.is_some() {
            return Ok(None);
        }
    }
    Ok(Some((xmin, roident, ts)))
}

/// What one copy moves: a SELECT on the source whose last two columns are
/// the version (`roident`, commit timestamp), the staging columns' types,
/// and the INSERT on the new node that reads the staging table.
struct Spec {
    select: String,
    stage_types: Vec<String>,
    insert: String,
    target: String,
    /// A table written by one transaction (a bulk load, the common case
    /// for big tables) goes straight from the source's COPY into the
    /// target's, in one transaction with that version: (the source's
    /// SELECT without the version, the target's COPY).
    direct: Option<(String, String)>,
}

/// The new node's end of the copy: one session, under replication origins.
pub struct Writer {
    client: Client,
    source: String,
    /// Source roident -> node whose origin it is.
    origins: HashMap<u32, String>,
    current_origin: Option<String>,
}

impl Writer {
    pub async fn open(dsn: &str, password: Option<&str>, source: &str) -> Result<Writer, String> {
        let client = crate::pg::connect(dsn, password)
            .await
            .map_err(|e| e.to_string())?;
        // Replica: no user trigger, no foreign-key check, none of the
        // agent's local-write triggers (the rows are the source's).
        client
            .batch_execute("SET session_replication_role = replica; SET synchronous_commit = off")
            .await
            .map_err(pg_err)?;
        Ok(Writer {
            client,
            source: source.to_owned(),
            origins: HashMap::new(),
            current_origin: None,
        })
    }

    /// The source's origins: a row written by node X there carries X's
    /// origin here too. Its own writes (roident 0) are the source's.
    pub async fn load_origins(&mut self, reader: &Client) -> Result<(), String> {
        let rows = reader
            .query(
                "SELECT roident::int8, roname FROM pg_catalog.pg_replication_origin",
                &[],
            )
            .await
            .map_err(pg_err)?;
        for r in rows {
            let id: i64 = r.get(0);
            let name: String = r.get(1);
            if let (Ok(id), Some(node)) = (u32::try_from(id), name.strip_prefix("mm_")) {
                self.origins.insert(id, node.to_owned());
            }
        }
        Ok(())
    }

    fn node_of(&self, roident: Option<i64>) -> String {
        roident
            .and_then(|r| u32::try_from(r).ok())
            .filter(|r| *r != 0)
            .and_then(|r| self.origins.get(&r).cloned())
            .unwrap_or_else(|| self.source.clone())
    }

    /// Copies one user table; returns (rows, bytes read).
    pub async fn table(&mut self, reader: &Client, t: &Table) -> Result<(u64, u64), String> {
        let cols: Vec<String> = t.columns.iter().map(|(n, _)| quote_ident(n)).collect();
        let mut select = String::from("SELECT ");
        for c in &cols {
            select.push_str(&format!("r.{c}, "));
        }
        select.push_str(&format!(
            "v.roident, v.\"timestamp\" FROM {} AS r \
             LEFT JOIN LATERAL pg_catalog.pg_xact_commit_timestamp_origin(r.xmin) AS v ON true",
            t.sql
        ));
        let stage: Vec<String> = (0..cols.len()).map(|i| format!("c{i}")).collect();
        let insert = if cols.is_empty() {
            format!("INSERT INTO {} SELECT FROM pg_temp.mm_stage", t.sql)
        } else {
            format!(
                "INSERT INTO {} ({}) OVERRIDING SYSTEM VALUE SELECT {} FROM pg_temp.mm_stage",
                t.sql,
                cols.join(", "),
                stage.join(", ")
            )
        };
        let plain = if cols.is_empty() {
            None
        } else {
            let list: Vec<String> = cols.iter().map(|c| format!("r.{c}")).collect();
            Some((
                format!("SELECT {} FROM {} AS r", list.join(", "), t.sql),
                format!("COPY {} ({}) FROM STDIN", t.sql, cols.join(", ")),
            ))
        };
        let spec = Spec {
            select,
            stage_types: t.columns.iter().map(|(_, ty)| ty.clone()).collect(),
            insert,
            target: t.sql.clone(),
            direct: plain,
        };
        self.copy(reader, &spec).await
    }

    /// Tombstones and truncate versions of the copied tables, by name (the
    /// relation ids differ between nodes).
    pub async fn agent_tables(&mut self, reader: &Client, tables: &[Table]) -> Result<(), String> {
        let oids: Vec<String> = tables.iter().map(|t| t.oid.to_string()).collect();
        let list = if oids.is_empty() {
            "NULL".to_owned()
        } else {
            oids.join(", ")
        };
        let tombstones = Spec {
            select: format!(
                "SELECT r.relid::regclass::text, r.key, v.roident, v.\"timestamp\" FROM mm.tombstones AS r \
                 LEFT JOIN LATERAL pg_catalog.pg_xact_commit_timestamp_origin(r.xmin) AS v ON true \
                 WHERE r.relid IN ({list})"
            ),
            stage_types: vec!["text".into(), "jsonb".into()],
            insert: "INSERT INTO mm.tombstones (relid, key) SELECT c0::regclass, c1 FROM pg_temp.mm_stage"
                .into(),
            target: "mm.tombstones".into(),
            direct: None,
        };
        self.copy(reader, &tombstones).await?;
        let truncates = Spec {
            select: format!(
                "SELECT r.relid::regclass::text, v.roident, v.\"timestamp\" FROM mm.truncates AS r \
                 LEFT JOIN LATERAL pg_catalog.pg_xact_commit_timestamp_origin(r.xmin) AS v ON true \
                 WHERE r.relid IN ({list})"
            ),
            stage_types: vec!["text".into()],
            insert: "INSERT INTO mm.truncates (relid) SELECT c0::regclass FROM pg_temp.mm_stage"
                .into(),
            target: "mm.truncates".into(),
            direct: None,
        };
        self.copy(reader, &truncates).await?;
        Ok(())
    }

    /// Sequences of the replicated schemas continue where the source's
    /// are, except cluster-global ones (their ranges come from Raft).
    pub async fn sequences(&mut self, reader: &Client) -> Result<(), String> {
        let rows = reader
            .query(
                "SELECT pg_catalog.format('%I.%I', s.schemaname, s.sequencename), \
                 s.schemaname || '.' || s.sequencename, s.last_value FROM pg_catalog.pg_sequences s \
                 WHERE s.last_value IS NOT NULL AND s.schemaname IN \
                 (SELECT pt.schemaname FROM pg_catalog.pg_publication_tables pt WHERE pt.pubname = 'mm')",
                &[],
            )
            .await
            .map_err(pg_err)?;
        let global: Vec<String> = self
            .client
            .query("SELECT DISTINCT sequence_name FROM mm.sequence_ranges", &[])
            .await
            .map_err(pg_err)?
            .iter()
            .map(|r| r.get(0))
            .collect();
        for r in rows {
            let quoted: String = r.get(0);
            let plain: String = r.get(1);
            let last: i64 = r.get(2);
            if global.contains(&plain) {
                continue;
            }
            self.client
                .execute(
                    "SELECT pg_catalog.setval(pg_catalog.to_regclass($1), $2)",
                    &[&quoted, &last],
                )
                .await
                .map_err(|e| format!("{plain}: {}", pg_err(e)))?;
        }
        Ok(())
    }

    async fn set_origin(&mut self, node: &str) -> Result<(), String> {
        let origin = names::origin_name(node);
        if self.current_origin.as_deref() == Some(origin.as_str()) {
            return Ok(());
        }
        if self.current_origin.is_some() {
            self.client
                .batch_execute("SELECT pg_catalog.pg_replication_origin_session_reset()")
                .await
                .map_err(pg_err)?;
            self.current_origin = None;
        }
        crate::pg::bind_origin(&self.client, &origin)
            .await
            .map_err(|e| format!("origin {origin}: {}", pg_err(e)))?;
        self.current_origin = Some(origin);
        Ok(())
    }

    /// Source rows into the staging table, then into the target one
    /// version at a time.
    async fn copy(&mut self, reader: &Client, spec: &Spec) -> Result<(u64, u64), String> {
        let started = std::time::Instant::now();
        // The rows of the most common version in one straight COPY, the
        // others (if any) through the staging table below.
        let mut rest = String::new();
        let mut direct = (0u64, 0u64);
        if let Some((select, copy_in)) = &spec.direct
            && let Some((xmin, roident, ts)) = dominant_version(reader, &spec.target).await?
        {
            let lit = xmin.replace('\'', "''");
            let one = format!("{select} WHERE r.xmin = '{lit}'::xid");
            direct = self
                .copy_direct(reader, spec, &one, copy_in, (roident, ts))
                .await?;
            rest = format!(" WHERE NOT (r.xmin = '{lit}'::xid)");
        }
        let mut ddl =
            String::from("DROP TABLE IF EXISTS pg_temp.mm_stage; CREATE TEMP TABLE mm_stage (");
        for (i, ty) in spec.stage_types.iter().enumerate() {
            ddl.push_str(&format!("c{i} {ty}, "));
        }
        ddl.push_str("o int8, t timestamptz)");
        self.client.batch_execute(&ddl).await.map_err(pg_err)?;

        let out = reader
            .copy_out(format!("COPY ({}{rest}) TO STDOUT", spec.select).as_str())
            .await
            .map_err(|e| format!("reading: {}", pg_err(e)))?;
        let sink = self
            .client
            .copy_in("COPY pg_temp.mm_stage FROM STDIN")
            .await
            .map_err(pg_err)?;
        let (rows, bytes) = pipe(out, sink).await?;
        let (rows, bytes) = (rows + direct.0, bytes + direct.1);
        let staged = started.elapsed();

        self.client
            .batch_execute("CREATE INDEX ON pg_temp.mm_stage (t, o); ANALYZE pg_temp.mm_stage")
            .await
            .map_err(pg_err)?;
        let groups = self
            .client
            .query(
                "SELECT o, t::text FROM pg_temp.mm_stage GROUP BY o, t \
                 ORDER BY t IS NOT NULL, o, t",
                &[],
            )
            .await
            .map_err(pg_err)?;
        let groups: Vec<(Option<i64>, Option<String>)> =
            groups.iter().map(|r| (r.get(0), r.get(1))).collect();

        // Rows without a version first, frozen before any versioned row
        // exists in the table (freezing would take those versions too).
        if groups.first().is_some_and(|(_, t)| t.is_none()) {
            let source = self.source.clone();
            self.set_origin(&source).await?;
            self.client
                .batch_execute(&format!("BEGIN; {} WHERE t IS NULL; COMMIT", spec.insert))
                .await
                .map_err(pg_err)?;
            self.freeze(&spec.target).await?;
        }
        let mut batch = String::new();
        let mut in_batch = 0;
        for (o, t) in &groups {
            let Some(t) = t else { continue };
            let node = self.node_of(*o);
            let origin = names::origin_name(&node);
            if self.current_origin.as_deref() != Some(origin.as_str()) {
                if !batch.is_empty() {
                    self.client.batch_execute(&batch).await.map_err(pg_err)?;
                    batch.clear();
                    in_batch = 0;
                }
                self.set_origin(&node).await?;
            }
            let ts = t.replace('\'', "''");
            let o_cond = match o {
                Some(o) => format!("o = {o}"),
                None => "o IS NULL".to_owned(),
            };
            batch.push_str(&format!(
                "BEGIN; SELECT pg_catalog.pg_replication_origin_xact_setup('0/0', '{ts}'::timestamptz); \
                 {} WHERE t = '{ts}'::timestamptz AND {o_cond}; COMMIT; ",
                spec.insert
            ));
            in_batch += 1;
            if in_batch >= GROUPS_PER_BATCH {
                self.client.batch_execute(&batch).await.map_err(pg_err)?;
                batch.clear();
                in_batch = 0;
            }
        }
        if !batch.is_empty() {
            self.client.batch_execute(&batch).await.map_err(pg_err)?;
        }
        self.client
            .batch_execute("DROP TABLE pg_temp.mm_stage")
            .await
            .map_err(pg_err)?;
        tracing::info!(
            target = %spec.target,
            rows,
            bytes,
            versions = groups.len(),
            staged_secs = staged.as_secs_f64(),
            total_secs = started.elapsed().as_secs_f64(),
            "add-node: table copied"
        );
        Ok((rows, bytes))
    }

    /// A table whose rows all share one version: one COPY straight in.
    async fn copy_direct(
        &mut self,
        reader: &Client,
        spec: &Spec,
        select: &str,
        copy_in: &str,
        (roident, ts): (Option<i64>, Option<String>),
    ) -> Result<(u64, u64), String> {
        let node = match ts {
            Some(_) => self.node_of(roident),
            None => self.source.clone(),
        };
        self.set_origin(&node).await?;
        self.client.batch_execute("BEGIN").await.map_err(pg_err)?;
        if let Some(ts) = &ts {
            self.client
                .execute(
                    "SELECT pg_catalog.pg_replication_origin_xact_setup('0/0', $1::text::timestamptz)",
                    &[ts],
                )
                .await
                .map_err(pg_err)?;
        }
        let out = reader
            .copy_out(format!("COPY ({select}) TO STDOUT").as_str())
            .await
            .map_err(|e| format!("reading: {}", pg_err(e)))?;
        let sink = self.client.copy_in(copy_in).await.map_err(pg_err)?;
        let (rows, bytes) = pipe(out, sink).await?;
        self.client.batch_execute("COMMIT").await.map_err(pg_err)?;
        if ts.is_none() {
            self.freeze(&spec.target).await?;
        }
        Ok((rows, bytes))
    }

    /// Freezes a table's rows (no version, as on the source), and checks.
    async fn freeze(&mut self, target: &str) -> Result<(), String> {
        for _ in 0..20 {
            self.client
                .batch_execute(&format!("VACUUM (FREEZE) {target}"))
                .await
                .map_err(pg_err)?;
            let left: i64 = self
                .client
                .query_one(
                    &format!(
                        "SELECT count(*) FROM {target} AS r \
                         WHERE pg_catalog.pg_xact_commit_timestamp(r.xmin) IS NOT NULL"
                    ),
                    &[],
                )
                .await
                .map_err(pg_err)?
                .get(0);
            if left == 0 {
                return Ok(());
            }
            // An older snapshot on this node keeps them from freezing.
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        Err(format!(
            "rows without a known version could not be frozen on this node (a long-running \
             transaction holds them back?): {target}"
        ))
    }
}
