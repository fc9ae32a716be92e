//! The rows of the copy: read from the source inside its exported snapshot
//! with each row's version, written on the new node one version at a time.
//!
//! A row's version is `pg_xact_commit_timestamp_origin(xmin)`: the origin
//! and commit timestamp of the transaction that wrote it. The new node's
//! conflict checks read the same thing from its own rows, so each group of
//! rows sharing a version is committed in a transaction of its own, under
//! that origin (`mm_<node>`, the node that wrote it) and with that commit
//! timestamp (`pg_replication_origin_xact_setup`): the copy is invisible to
//! last-writer-wins. Rows without a version get the oldest one there is
//! (`UNVERSIONED`).
//!
//! Every statement built here names user objects only as quoted
//! identifiers, and reads the staging table through columns of our own
//! naming (`c0`, `c1`, ..., `o`, `t`), so no user name can capture ours.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures_util::{SinkExt, StreamExt, pin_mut};
use tokio_postgres::Client;

use super::schema::Source;
use crate::apply::sql::quote_ident;
use crate::stream::names;

/// The version given to rows that have none on the source (written
/// before `track_commit_timestamp` was on, or with their commit timestamps
/// truncated away): older than any real change, as an unknown version is
/// to the conflict rules, so every later change wins against them on the
/// new node exactly as on the source. It cannot be NULL: PostgreSQL
/// records a commit timestamp for every transaction, and freezing a row
/// keeps its xmin's.
pub(crate) const UNVERSIONED: &str = "1970-01-01 00:00:00+00";

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
    /// Every column of a built-in type (the same type OIDs on every node):
    /// the rows can travel in COPY's binary format, which both ends parse
    /// and print faster. Binary arrays and records carry type OIDs, which
    /// differ between nodes for user-defined types: those go as text.
    pub binary: bool,
    /// On-disk size (all partitions), to copy the largest tables first.
    pub bytes: i64,
    /// The planner's row estimate (all partitions; 0 if never analyzed).
    pub rows_estimate: i64,
}

/// Rows and bytes the copy has moved so far, counted as they flow (a
/// progress display would otherwise stand still for a table's length).
#[derive(Debug)]
pub struct Flow {
    pub rows: AtomicU64,
    pub bytes: AtomicU64,
    pub started: std::time::Instant,
}

impl Default for Flow {
    fn default() -> Flow {
        Flow {
            rows: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            started: std::time::Instant::now(),
        }
    }
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
            "SELECT c.oid, n.nspname::text, c.relname::text, \
             (SELECT coalesce(sum(pg_catalog.pg_relation_size(p.relid)), 0)::int8 \
              FROM pg_catalog.pg_partition_tree(c.oid) AS p), \
             (SELECT coalesce(sum(greatest(k.reltuples, 0)), 0)::int8 \
              FROM pg_catalog.pg_partition_tree(c.oid) AS p \
              JOIN pg_catalog.pg_class AS k ON k.oid = p.relid), \
             NOT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute a WHERE a.attrelid = c.oid \
              AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = '' \
              AND a.atttypid >= 16384 /* FirstNormalObjectId */) \
             FROM pg_catalog.pg_publication_tables pt \
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
            bytes: r.get(3),
            rows_estimate: r.get(4),
            binary: r.get(5),
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
    flow: &Flow,
) -> Result<(u64, u64), String> {
    pin_mut!(out);
    pin_mut!(sink);
    let mut bytes = 0u64;
    while let Some(chunk) = out.next().await {
        let chunk = chunk.map_err(|e| format!("reading: {}", pg_err(e)))?;
        bytes += chunk.len() as u64;
        // PostgreSQL sends one COPY data message per row.
        flow.rows.fetch_add(1, Ordering::Relaxed);
        flow.bytes.fetch_add(chunk.len() as u64, Ordering::Relaxed);
        sink.feed(chunk).await.map_err(pg_err)?;
    }
    let rows = sink.as_mut().finish().await.map_err(pg_err)?;
    Ok((rows, bytes))
}

/// The version most rows of `table` share (the transaction that loaded
/// it, typically), for one straight COPY: (xmin, roident, commit
/// timestamp; None for rows without a known one). None for an empty table.
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
    Ok(Some((xmin, v.get(0), v.get(1))))
}

/// What one copy moves: a SELECT on the source whose last two columns are
/// the version (`roident`, commit timestamp), the staging columns' types,
/// and the INSERT on the new node that reads the staging table.
struct Spec {
    select: String,
    stage_types: Vec<String>,
    insert: String,
    target: String,
    /// The rows of a table's most common version (a bulk load, the common
    /// case for big tables) go straight from the source's COPY into the
    /// target's, in one transaction with that version: (the source's
    /// SELECT without the version, the target's COPY).
    direct: Option<(String, String)>,
    /// COPY in binary format (every column of a built-in type).
    binary: bool,
}

/// PostgreSQL lets one session at a time bind a replication origin (a
/// second gets "already active"): the copy's parallel writers take turns
/// per origin, each holding at most one, so they never wait on each other
/// in a circle.
#[derive(Debug, Default)]
pub struct OriginLocks(std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>);

impl OriginLocks {
    fn get(&self, origin: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut map = match self.0.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        map.entry(origin.to_owned()).or_default().clone()
    }
}

/// A session on the source inside the copy's exported snapshot: every
/// reader (one per parallel worker) sees exactly the same rows.
pub async fn snapshot_reader(source: &Source<'_>) -> Result<Client, String> {
    let reader = crate::pg::connect(source.dsn, source.password)
        .await
        .map_err(|e| e.to_string())?;
    reader
        .batch_execute(&format!(
            "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY; SET TRANSACTION SNAPSHOT '{}'",
            source.snapshot.replace('\'', "''")
        ))
        .await
        .map_err(|e| format!("importing the snapshot: {}", pg_err(e)))?;
    Ok(reader)
}

/// Copies `tables` with up to `workers` sessions at each end, largest
/// first; `done` is told of each table copied. Errors name
/// the table.
pub async fn tables(
    source: &Source<'_>,
    local: (&str, Option<&str>),
    source_node: &str,
    tables: &[Table],
    workers: usize,
    flow: &Arc<Flow>,
    done: &(dyn Fn(&Table) + Sync),
) -> Result<(), String> {
    let mut order: Vec<&Table> = tables.iter().collect();
    order.sort_by_key(|t| std::cmp::Reverse(t.bytes));
    let queue = std::sync::Mutex::new(std::collections::VecDeque::from(order));
    let next = || match queue.lock() {
        Ok(mut q) => q.pop_front(),
        Err(p) => p.into_inner().pop_front(),
    };
    let locks = Arc::new(OriginLocks::default());
    let worker = |_: usize| {
        let locks = locks.clone();
        let next = &next;
        async move {
            let Some(mut t) = next() else {
                return Ok(());
            };
            let reader = snapshot_reader(source).await?;
            let mut writer =
                Writer::open(local.0, local.1, source_node, locks, flow.clone()).await?;
            writer
                .load_origins(&reader)
                .await
                .map_err(|e| format!("reading replication origins: {e}"))?;
            loop {
                writer
                    .table(&reader, t)
                    .await
                    .map_err(|e| format!("{}: {e}", t.display))?;
                done(t);
                match next() {
                    Some(n) => t = n,
                    None => return Ok::<(), String>(()),
                }
            }
        }
    };
    futures_util::future::try_join_all((0..workers.max(1)).map(worker)).await?;
    Ok(())
}

/// The new node's end of the copy: one session, under replication origins.
pub struct Writer {
    client: Client,
    source: String,
    /// Source roident -> node whose origin it is.
    origins: HashMap<u32, String>,
    locks: Arc<OriginLocks>,
    flow: Arc<Flow>,
    /// The origin this session has bound, and its turn.
    current_origin: Option<(String, tokio::sync::OwnedMutexGuard<()>)>,
}

impl Writer {
    pub async fn open(
        dsn: &str,
        password: Option<&str>,
        source: &str,
        locks: Arc<OriginLocks>,
        flow: Arc<Flow>,
    ) -> Result<Writer, String> {
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
            locks,
            flow,
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
            if let (Ok(id), Some(node)) = (u32::try_from(id), names::node_of_origin(&name)) {
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
            "v.roident::int8, v.\"timestamp\" FROM {} AS r \
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
        let format = if t.binary { " (FORMAT binary)" } else { "" };
        let plain = if cols.is_empty() {
            None
        } else {
            let list: Vec<String> = cols.iter().map(|c| format!("r.{c}")).collect();
            Some((
                format!("SELECT {} FROM {} AS r", list.join(", "), t.sql),
                format!("COPY {} ({}) FROM STDIN{format}", t.sql, cols.join(", ")),
            ))
        };
        let spec = Spec {
            select,
            stage_types: t.columns.iter().map(|(_, ty)| ty.clone()).collect(),
            insert,
            target: t.sql.clone(),
            direct: plain,
            binary: t.binary,
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
                "SELECT r.relid::regclass::text, r.key, v.roident::int8, v.\"timestamp\" FROM mm.tombstones AS r \
                 LEFT JOIN LATERAL pg_catalog.pg_xact_commit_timestamp_origin(r.xmin) AS v ON true \
                 WHERE r.relid IN ({list})"
            ),
            stage_types: vec!["text".into(), "jsonb".into()],
            insert: "INSERT INTO mm.tombstones (relid, key) SELECT c0::regclass, c1 FROM pg_temp.mm_stage"
                .into(),
            target: "mm.tombstones".into(),
            direct: None,
            binary: false,
        };
        self.copy(reader, &tombstones).await?;
        let truncates = Spec {
            select: format!(
                "SELECT r.relid::regclass::text, v.roident::int8, v.\"timestamp\" FROM mm.truncates AS r \
                 LEFT JOIN LATERAL pg_catalog.pg_xact_commit_timestamp_origin(r.xmin) AS v ON true \
                 WHERE r.relid IN ({list})"
            ),
            stage_types: vec!["text".into()],
            insert: "INSERT INTO mm.truncates (relid) SELECT c0::regclass FROM pg_temp.mm_stage"
                .into(),
            target: "mm.truncates".into(),
            direct: None,
            binary: false,
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
        if self
            .current_origin
            .as_ref()
            .is_some_and(|(o, _)| *o == origin)
        {
            return Ok(());
        }
        self.release_origin().await?;
        let turn = self.locks.get(&origin).lock_owned().await;
        crate::pg::bind_origin(&self.client, &origin)
            .await
            .map_err(|e| format!("origin {origin}: {}", pg_err(e)))?;
        self.current_origin = Some((origin, turn));
        Ok(())
    }

    /// Unbinds the session's origin and gives another writer its turn.
    async fn release_origin(&mut self) -> Result<(), String> {
        if self.current_origin.is_some() {
            self.client
                .batch_execute("SELECT pg_catalog.pg_replication_origin_session_reset()")
                .await
                .map_err(pg_err)?;
            self.current_origin = None;
        }
        Ok(())
    }

    /// Source rows into the staging table, then into the target one
    /// version at a time; the rows of the most common version go straight
    /// from COPY to COPY instead.
    async fn copy(&mut self, reader: &Client, spec: &Spec) -> Result<(u64, u64), String> {
        let started = std::time::Instant::now();
        let format = if spec.binary { " (FORMAT binary)" } else { "" };
        let dominant = match &spec.direct {
            Some(_) => dominant_version(reader, &spec.target).await?,
            None => None,
        };
        let only = |xmin: &str, yes: bool| {
            let lit = xmin.replace('\'', "''");
            match yes {
                true => format!(" WHERE r.xmin = '{lit}'::xid"),
                false => format!(" WHERE NOT (r.xmin = '{lit}'::xid)"),
            }
        };
        let rest = dominant
            .as_ref()
            .map(|(xmin, _, _)| only(xmin, false))
            .unwrap_or_default();

        // No origin is needed to stage: the other writers may use it.
        let mut ddl =
            String::from("DROP TABLE IF EXISTS pg_temp.mm_stage; CREATE TEMP TABLE mm_stage (");
        for (i, ty) in spec.stage_types.iter().enumerate() {
            ddl.push_str(&format!("c{i} {ty}, "));
        }
        ddl.push_str("o int8, t timestamptz)");
        self.client.batch_execute(&ddl).await.map_err(pg_err)?;
        let out = reader
            .copy_out(format!("COPY ({}{rest}) TO STDOUT{format}", spec.select).as_str())
            .await
            .map_err(|e| format!("reading: {}", pg_err(e)))?;
        let sink = self
            .client
            .copy_in(format!("COPY pg_temp.mm_stage FROM STDIN{format}").as_str())
            .await
            .map_err(pg_err)?;
        let (mut rows, mut bytes) = pipe(out, sink, &self.flow).await?;
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

        if let Some(((xmin, roident, ts), (select, copy_in))) =
            dominant.as_ref().zip(spec.direct.as_ref())
        {
            let select = format!("{select}{}", only(xmin, true));
            let (r, b) = self
                .copy_direct(reader, &select, copy_in, format, *roident, ts)
                .await?;
            (rows, bytes) = (rows + r, bytes + b);
        }

        let mut batch = String::new();
        let mut in_batch = 0;
        for (o, t) in &groups {
            let node = match t {
                Some(_) => self.node_of(*o),
                None => self.source.clone(),
            };
            let origin = names::origin_name(&node);
            if self.current_origin.as_ref().map(|(o, _)| o) != Some(&origin) {
                if !batch.is_empty() {
                    self.client.batch_execute(&batch).await.map_err(pg_err)?;
                    batch.clear();
                    in_batch = 0;
                }
                self.set_origin(&node).await?;
            }
            let (ts, cond) = match t {
                Some(t) => {
                    let ts = t.replace('\'', "''");
                    let o_cond = match o {
                        Some(o) => format!("o = {o}"),
                        None => "o IS NULL".to_owned(),
                    };
                    (ts.clone(), format!("t = '{ts}'::timestamptz AND {o_cond}"))
                }
                None => (UNVERSIONED.to_owned(), "t IS NULL".to_owned()),
            };
            batch.push_str(&format!(
                "BEGIN; SELECT pg_catalog.pg_replication_origin_xact_setup('0/0', '{ts}'::timestamptz); \
                 {} WHERE {cond}; COMMIT; ",
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
        self.release_origin().await?;
        self.client
            .batch_execute("DROP TABLE pg_temp.mm_stage")
            .await
            .map_err(pg_err)?;
        tracing::info!(
            target = %spec.target,
            rows,
            bytes,
            versions = groups.len() + usize::from(dominant.is_some()),
            binary = spec.binary,
            staged_secs = staged.as_secs_f64(),
            total_secs = started.elapsed().as_secs_f64(),
            "add-node: table copied"
        );
        Ok((rows, bytes))
    }

    /// The rows of one version: one COPY straight in, in one transaction
    /// under that version.
    async fn copy_direct(
        &mut self,
        reader: &Client,
        select: &str,
        copy_in: &str,
        format: &str,
        roident: Option<i64>,
        ts: &Option<String>,
    ) -> Result<(u64, u64), String> {
        let node = match ts {
            Some(_) => self.node_of(roident),
            None => self.source.clone(),
        };
        self.set_origin(&node).await?;
        self.client.batch_execute("BEGIN").await.map_err(pg_err)?;
        let ts = ts.as_deref().unwrap_or(UNVERSIONED);
        self.client
            .execute(
                "SELECT pg_catalog.pg_replication_origin_xact_setup('0/0', $1::text::timestamptz)",
                &[&ts],
            )
            .await
            .map_err(pg_err)?;
        let out = reader
            .copy_out(format!("COPY ({select}) TO STDOUT{format}").as_str())
            .await
            .map_err(|e| format!("reading: {}", pg_err(e)))?;
        let sink = self.client.copy_in(copy_in).await.map_err(pg_err)?;
        let (rows, bytes) = pipe(out, sink, &self.flow).await?;
        self.client.batch_execute("COMMIT").await.map_err(pg_err)?;
        Ok((rows, bytes))
    }
}
