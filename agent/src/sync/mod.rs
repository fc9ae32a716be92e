//! add-node with data, on the node being added (N): the initial copy from
//! the source node S, run while the cluster keeps taking writes everywhere.
//!
//! The join leader records N `syncing` with its source (`AddSyncingNode`);
//! from then on the other nodes stream N's (empty) changes out, but no
//! stream into N starts (`cluster.rs`). This task sees that state and copies:
//!
//! 1. For every other active node X: the slot `X -> N` (N's stream will
//!    read it; created now, it holds every X commit after its consistent
//!    point c_X), then a marker transaction on X written after it, and a
//!    wait until S has APPLIED the marker (S's `mm.apply_progress` for X,
//!    never a received position: keepalives move those).
//! 2. The slot `S -> N` created with an exported snapshot (consistent point
//!    c_S): the snapshot holds exactly S's commits before c_S, the slot
//!    exactly those after.
//! 3. Inside that snapshot: S's `mm.apply_progress` (p_X per origin: it is
//!    written in the applied transactions themselves, so it names exactly
//!    the X commits the snapshot contains; p_X >= marker >= c_X), the table
//!    definitions (created on N if missing, else compared), every row with
//!    its version, the tombstones and truncate versions.
//! 4. One local transaction records the copy `done` together with N's
//!    progress: S at c_S, every X at p_X. The leader then lets the streams
//!    start (`joining`): X's stream into N resumes after p_X (everything up
//!    to it is in the copy, everything after it is in X's slot since
//!    c_X <= p_X), S's after c_S. Nothing lost, nothing twice.
//!
//! Copied rows keep their versions: rows are grouped by the source row's
//! (origin, commit timestamp) and each group is committed in its own
//! transaction under that origin with that timestamp
//! (`pg_replication_origin_xact_setup`), so a row on N carries the very
//! version it has on S, and last-writer-wins on N compares late concurrent
//! changes against it, not against the copy. Rows without a known version
//! (written before track_commit_timestamp was on) get the oldest version
//! there is (`copy::UNVERSIONED`), which every later change beats, as an
//! unknown version does on S.
//!
//! An interrupted copy (any process killed at any step) starts again from
//! the beginning: the tables it was filling are truncated first
//! (`mm.sync_state`), the `S -> N` slot is made anew.

mod copy;
mod schema;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mm_proto::api::{NodeInfo, NodeState, SyncReport};
use mm_proto::client::{ReplicationClient, ReplicationConfig, SnapshotAction};
use mm_proto::lsn::Lsn;
use tokio::sync::watch;
use tokio_postgres::Client;
use tracing::{info, warn};

use crate::raft::ClusterState;
use crate::stream::names;

/// Tables copied at once (a session at each end each). Two keeps both
/// servers busy on a small machine; more would mostly wait on the same
/// disks and replication origins.
const COPY_WORKERS: usize = 2;

/// Why an attempt failed. Each names the node and the step.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("on {node}: {step}: {detail}")]
    Node {
        node: String,
        step: &'static str,
        detail: String,
    },
    #[error("schema: {0}")]
    Schema(String),
}

impl SyncError {
    fn at(node: &str, step: &'static str) -> impl FnOnce(String) -> SyncError + use<> {
        let node = node.to_owned();
        move |detail| SyncError::Node { node, step, detail }
    }
}

/// Shared with the API (`GET /v1/sync`).
#[derive(Debug, Default)]
pub struct Progress {
    report: Mutex<SyncReport>,
    /// The current attempt's rows and bytes, as they flow.
    flow: Mutex<Arc<copy::Flow>>,
}

impl Progress {
    pub fn snapshot(&self) -> SyncReport {
        let mut r = match self.report.lock() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        };
        let flow = self.flow();
        r.rows = flow.rows.load(Ordering::Relaxed);
        r.bytes = flow.bytes.load(Ordering::Relaxed);
        if r.phase == "copying" {
            r.elapsed_secs = flow.started.elapsed().as_secs_f64();
        }
        r
    }

    fn flow(&self) -> Arc<copy::Flow> {
        match self.flow.lock() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// Counts from zero again (a new attempt copies everything again).
    fn new_flow(&self) -> Arc<copy::Flow> {
        let flow = Arc::new(copy::Flow::default());
        match self.flow.lock() {
            Ok(mut g) => *g = flow.clone(),
            Err(p) => *p.into_inner() = flow.clone(),
        }
        flow
    }

    fn update(&self, f: impl FnOnce(&mut SyncReport)) {
        let mut g = match self.report.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        f(&mut g);
    }

    fn phase(&self, phase: &str, detail: String) {
        info!(phase, %detail, "add-node copy");
        self.update(|r| {
            r.phase = phase.to_owned();
            r.detail = detail;
        });
    }
}

/// The copy task of one agent.
pub struct Syncer {
    pub node: String,
    pub dsn: String,
    pub password: Option<String>,
    pub progress: Arc<Progress>,
}

/// What the Raft state asks of this node.
#[derive(Debug, Clone, PartialEq)]
struct Job {
    source: NodeInfo,
    /// The other active nodes (not the source, not this one).
    others: Vec<NodeInfo>,
}

fn job(state: &ClusterState, me: &str) -> Option<Job> {
    let mine = state.node_by_name(me)?;
    if mine.state != NodeState::Syncing {
        return None;
    }
    let source = state.node_by_name(state.sync_sources.get(me)?)?.clone();
    let others = state
        .nodes
        .values()
        .filter(|n| n.name != me && n.name != source.name && n.state == NodeState::Active)
        .cloned()
        .collect();
    Some(Job { source, others })
}

impl Syncer {
    pub async fn run(self, mut cluster: watch::Receiver<ClusterState>) {
        self.progress.phase("idle", "not being added".into());
        loop {
            let current = job(&cluster.borrow_and_update(), &self.node);
            if let Some(j) = current {
                // One update: a report never shows the previous attempt's
                // refusal under this attempt's number (the leader reads
                // them together).
                self.progress.update(|r| {
                    r.source = Some(j.source.name.clone());
                    r.attempts += 1;
                    r.phase = "starting".into();
                    r.detail = format!("copying from {}", j.source.name);
                });
                let started = Instant::now();
                match self.attempt(&j, started).await {
                    Ok(()) => {}
                    Err(e) => {
                        // A schema that does not fit will not fit on its
                        // own: the join is refused (and looked at again
                        // every few seconds, for when it is fixed).
                        let phase = if matches!(e, SyncError::Schema(_)) {
                            "refused"
                        } else {
                            "failed"
                        };
                        warn!(error = %e, phase, "add-node copy did not finish; trying again in 3 s");
                        self.progress.update(|r| {
                            r.phase = phase.into();
                            r.error = Some(e.to_string());
                        });
                        tokio::time::sleep(Duration::from_secs(3)).await;
                        continue;
                    }
                }
            }
            tokio::select! {
                r = cluster.changed() => if r.is_err() { return },
                _ = tokio::time::sleep(Duration::from_secs(2)) => {}
            }
        }
    }

    async fn attempt(&self, j: &Job, started: Instant) -> Result<(), SyncError> {
        let me = self.node.as_str();
        let local_err = SyncError::at(me, "local database");
        let local = crate::pg::connect(&self.dsn, self.password.as_deref())
            .await
            .map_err(|e| local_err(e.to_string()))?;
        let state = read_state(&local).await?;
        if let Some(State { source, phase, .. }) = &state
            && phase == "done"
        {
            self.progress.update(|r| {
                r.phase = "done".into();
                r.detail = format!("copied from {source}; waiting for the streams to start");
                r.error = None;
            });
            return Ok(());
        }
        if let Some(st) = &state {
            self.progress
                .phase("cleanup", "undoing an interrupted copy".into());
            undo(&local, &st.tables).await?;
        }
        let src = &j.source;

        // Before any slot pins WAL anywhere: do the tables fit?
        self.progress.phase(
            "schema",
            format!("comparing the tables with {}'s", src.name),
        );
        {
            let plain = crate::pg::connect(&src.peer_dsn, self.password.as_deref())
                .await
                .map_err(|e| SyncError::at(&src.name, "connecting")(e.to_string()))?;
            let tables = copy::published_tables(&plain)
                .await
                .map_err(SyncError::at(&src.name, "listing the replicated tables"))?;
            schema::check(&local, &tables).await?;
        }

        // 1. Every other node's slot for us, and S past a marker after it.
        for x in &j.others {
            self.progress.phase(
                "waiting",
                format!("slot {} on {}", names::slot_name(&x.name, me), x.name),
            );
            let marker = slot_and_marker(x, me, self.password.as_deref()).await?;
            self.progress.phase(
                "waiting",
                format!(
                    "for {} to apply {}'s changes up to {marker} (its marker)",
                    src.name, x.name
                ),
            );
            wait_applied(src, &x.name, marker, self.password.as_deref()).await?;
        }

        // 2. The source's slot for us, with its snapshot.
        self.progress.phase(
            "snapshot",
            format!("slot {} on {}", names::slot_name(&src.name, me), src.name),
        );
        let (holder, c_s, snapshot) = export_slot(src, me, self.password.as_deref()).await?;

        // 3. Schema, rows, tombstones, inside that snapshot.
        let source = schema::Source {
            dsn: &src.peer_dsn,
            password: self.password.as_deref(),
            snapshot: &snapshot,
        };
        let reader = copy::snapshot_reader(&source)
            .await
            .map_err(SyncError::at(&src.name, "reading the snapshot"))?;
        let tables = copy::published_tables(&reader)
            .await
            .map_err(SyncError::at(&src.name, "listing the replicated tables"))?;
        let flow = self.progress.new_flow();
        self.progress.update(|r| {
            r.tables_total = tables.len() as u64;
            r.tables_done = 0;
            r.rows_estimate = tables.iter().map(|t| t.rows_estimate.max(0) as u64).sum();
        });
        self.progress.phase(
            "schema",
            format!("{} replicated tables on {}", tables.len(), src.name),
        );
        let local_dsn = (self.dsn.as_str(), self.password.as_deref());
        // Recorded before the tables are made (in one transaction), so a
        // retry knows their keys and indexes are still to come.
        let needs_create = schema::needs_create(&local, &tables).await?;
        let created = needs_create
            || state
                .as_ref()
                .is_some_and(|s| s.created && !s.post_data_done);
        let post_done = !needs_create && state.as_ref().is_some_and(|s| s.post_data_done);
        let progress_rows = copy::source_progress(&reader)
            .await
            .map_err(SyncError::at(&src.name, "reading mm.apply_progress"))?;
        record_copying(&local, &src.name, &tables, created, post_done).await?;
        if needs_create {
            schema::pre_data(local_dsn, &source, &tables).await?;
        }

        self.progress.phase(
            "copying",
            format!(
                "{} tables from {} ({COPY_WORKERS} at a time)",
                tables.len(),
                src.name
            ),
        );
        let done = |t: &copy::Table| {
            self.progress.update(|r| {
                r.tables_done += 1;
                r.elapsed_secs = started.elapsed().as_secs_f64();
                r.detail = format!("{} from {}", t.display, src.name);
            });
        };
        copy::tables(
            &source,
            local_dsn,
            &src.name,
            &tables,
            COPY_WORKERS,
            &flow,
            &done,
        )
        .await
        .map_err(|detail| SyncError::Node {
            node: me.to_owned(),
            step: "copying a table",
            detail,
        })?;
        let mut writer = copy::Writer::open(
            &self.dsn,
            self.password.as_deref(),
            &src.name,
            Default::default(),
            flow.clone(),
        )
        .await
        .map_err(SyncError::at(me, "local database"))?;
        writer
            .load_origins(&reader)
            .await
            .map_err(SyncError::at(&src.name, "reading replication origins"))?;
        self.progress
            .phase("copying", "tombstones and truncate versions".into());
        writer
            .agent_tables(&reader, &tables)
            .await
            .map_err(|e| SyncError::Node {
                node: me.to_owned(),
                step: "copying tombstones",
                detail: e,
            })?;
        writer
            .sequences(&reader)
            .await
            .map_err(|e| SyncError::Node {
                node: me.to_owned(),
                step: "setting sequences",
                detail: e,
            })?;
        if created && !post_done {
            self.progress
                .phase("schema", "indexes, keys and triggers".into());
            schema::post_data(local_dsn, &source, &tables).await?;
            local
                .batch_execute("UPDATE mm.sync_state SET post_data_done = true")
                .await
                .map_err(|e| SyncError::at(me, "recording the copy")(e.to_string()))?;
        }
        crate::schema::install_triggers(&local)
            .await
            .map_err(|e| SyncError::Schema(e.to_string()))?;
        let _ = reader.batch_execute("COMMIT").await;
        // The snapshot was needed until here (pg_dump reads it).
        holder.close().await;

        // 4. Done, with the progress the copy stands for.
        finish(&local, &src.name, c_s, &progress_rows, me).await?;
        let elapsed = started.elapsed().as_secs_f64();
        self.progress.update(|r| {
            r.phase = "done".into();
            r.detail = format!(
                "copied from {} ({} rows); waiting for the streams to start",
                src.name,
                flow.rows.load(Ordering::Relaxed)
            );
            r.elapsed_secs = elapsed;
            r.error = None;
        });
        info!(source = %src.name, %c_s, elapsed, "add-node copy done");
        Ok(())
    }
}

/// `mm.sync_state`, if a copy ever started.
struct State {
    source: String,
    phase: String,
    tables: Vec<String>,
    created: bool,
    post_data_done: bool,
}

async fn read_state(local: &Client) -> Result<Option<State>, SyncError> {
    let row = local
        .query_opt(
            "SELECT source, phase, tables, created, post_data_done FROM mm.sync_state",
            &[],
        )
        .await
        .map_err(|e| SyncError::Node {
            node: "local".into(),
            step: "reading mm.sync_state",
            detail: e.to_string(),
        })?;
    Ok(row.map(|r| State {
        source: r.get(0),
        phase: r.get(1),
        tables: r.get(2),
        created: r.get(3),
        post_data_done: r.get(4),
    }))
}

/// Empties what an interrupted copy filled (the tables it had made, if it
/// got that far).
async fn undo(local: &Client, tables: &[String]) -> Result<(), SyncError> {
    let err = |e: tokio_postgres::Error| SyncError::Node {
        node: "local".into(),
        step: "undoing an interrupted copy",
        detail: match e.as_db_error() {
            Some(d) => d.message().to_owned(),
            None => e.to_string(),
        },
    };
    let mut sql = String::from("BEGIN; ");
    for t in tables {
        // Stored as quoted, qualified names by `record_copying`.
        let exists: bool = local
            .query_one("SELECT pg_catalog.to_regclass($1) IS NOT NULL", &[t])
            .await
            .map_err(err)?
            .get(0);
        if exists {
            sql.push_str(&format!("TRUNCATE {t}; "));
        }
    }
    sql.push_str(
        // mm.sync_state stays: whether the tables still lack their keys
        // must survive a crash right after this.
        "DELETE FROM mm.tombstones; DELETE FROM mm.truncates; DELETE FROM mm.apply_progress; COMMIT",
    );
    local.batch_execute(&sql).await.map_err(err)
}

async fn record_copying(
    local: &Client,
    source: &str,
    tables: &[copy::Table],
    created: bool,
    post_data_done: bool,
) -> Result<(), SyncError> {
    let names: Vec<String> = tables.iter().map(|t| t.sql.clone()).collect();
    local
        .execute(
            "INSERT INTO mm.sync_state (source, phase, tables, created, post_data_done) \
             VALUES ($1, 'copying', $2, $3, $4) ON CONFLICT (singleton) DO UPDATE SET \
             source = EXCLUDED.source, phase = 'copying', tables = EXCLUDED.tables, \
             created = EXCLUDED.created, post_data_done = EXCLUDED.post_data_done, \
             started_at = now(), finished_at = NULL",
            &[&source, &names, &created, &post_data_done],
        )
        .await
        .map(|_| ())
        .map_err(|e| SyncError::Node {
            node: "local".into(),
            step: "recording the copy",
            detail: e.to_string(),
        })
}

/// Step 1 for node `x`: its slot for `me`, then a marker transaction on it,
/// whose end LSN is returned.
async fn slot_and_marker(x: &NodeInfo, me: &str, password: Option<&str>) -> Result<Lsn, SyncError> {
    let err = SyncError::at(&x.name, "creating the slot for the new node");
    let mut repl = replication(x, me, password).await.map_err(err)?;
    let slot = names::slot_name(&x.name, me);
    crate::stream::ensure_slot(&mut repl, &slot)
        .await
        .map_err(|e| SyncError::at(&x.name, "creating the slot for the new node")(e.to_string()))?;
    repl.close().await;
    let client = crate::pg::connect(&x.peer_dsn, password)
        .await
        .map_err(|e| SyncError::at(&x.name, "writing the join marker")(e.to_string()))?;
    // A transaction of its own (a transactional message): the source
    // applies it like any other and records its end, which is past the
    // message's position, in mm.apply_progress.
    let lsn: String = client
        .query_one(
            "SELECT pg_catalog.pg_logical_emit_message(true, 'mm.join', $1::text)::text",
            &[&me],
        )
        .await
        .and_then(|r| r.try_get(0))
        .map_err(|e| SyncError::at(&x.name, "writing the join marker")(e.to_string()))?;
    lsn.parse::<Lsn>()
        .map_err(|e| SyncError::at(&x.name, "writing the join marker")(e.to_string()))
}

/// Waits until `src` has applied `origin_node`'s changes past `lsn`.
async fn wait_applied(
    src: &NodeInfo,
    origin_node: &str,
    lsn: Lsn,
    password: Option<&str>,
) -> Result<(), SyncError> {
    let client = crate::pg::connect(&src.peer_dsn, password)
        .await
        .map_err(|e| SyncError::at(&src.name, "reading its apply progress")(e.to_string()))?;
    let origin = names::origin_name(origin_node);
    let started = Instant::now();
    loop {
        let row = client
            .query_opt(
                "SELECT remote_lsn::text FROM mm.apply_progress WHERE origin = $1",
                &[&origin],
            )
            .await
            .map_err(|e| SyncError::at(&src.name, "reading its apply progress")(e.to_string()))?;
        let at: Option<Lsn> = row
            .and_then(|r| r.try_get::<_, String>(0).ok())
            .and_then(|s| s.parse().ok());
        if at.is_some_and(|a| a >= lsn) {
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(600) {
            return Err(SyncError::Node {
                node: src.name.clone(),
                step: "waiting for its stream",
                detail: format!(
                    "it has not applied {origin_node}'s changes up to {lsn} in 600 s (at {}): is that stream paused or failing?",
                    at.map(|a| a.to_string())
                        .unwrap_or_else(|| "nothing".into())
                ),
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn replication(
    n: &NodeInfo,
    me: &str,
    password: Option<&str>,
) -> Result<ReplicationClient, String> {
    let mut cfg = ReplicationConfig::from_dsn(&n.peer_dsn)
        .map_err(|e| e.to_string())?
        .with_portable_text_settings()
        .with_application_name(format!("mm_join_{me}"))
        .with_connect_timeout(Duration::from_secs(10));
    if let Some(pw) = password {
        cfg = cfg.with_password(pw.to_owned());
    }
    ReplicationClient::connect(&cfg)
        .await
        .map_err(|e| e.to_string())
}

/// Step 2: the slot `src -> me` made anew with an exported snapshot. The
/// returned connection holds the snapshot until it is closed.
async fn export_slot(
    src: &NodeInfo,
    me: &str,
    password: Option<&str>,
) -> Result<(ReplicationClient, Lsn, String), SyncError> {
    let err = |e: String| SyncError::at(&src.name, "creating the snapshot slot")(e);
    let mut repl = replication(src, me, password).await.map_err(err)?;
    let slot = names::slot_name(&src.name, me);
    let exists = repl
        .simple_query(&format!(
            "SELECT 1 FROM pg_catalog.pg_replication_slots WHERE slot_name = '{}'",
            slot.replace('\'', "''")
        ))
        .await
        .map_err(|e| err(e.to_string()))?;
    if !exists.is_empty() {
        // Left by an interrupted copy: its snapshot is gone with it.
        repl.drop_slot(&slot, true)
            .await
            .map_err(|e| err(e.to_string()))?;
    }
    let created = repl
        .create_logical_slot(&slot, "pgoutput", SnapshotAction::Export, false)
        .await
        .map_err(|e| err(e.to_string()))?;
    let snapshot = created
        .snapshot_name
        .ok_or_else(|| err("no snapshot was exported".into()))?;
    info!(%slot, consistent_point = %created.consistent_point, "add-node: snapshot slot created");
    Ok((repl, created.consistent_point, snapshot))
}

/// Step 4: the copy is done, and N's progress is the copy's, atomically.
async fn finish(
    local: &Client,
    source: &str,
    c_s: Lsn,
    progress: &[(String, String)],
    me: &str,
) -> Result<(), SyncError> {
    let err = |e: tokio_postgres::Error| SyncError::Node {
        node: me.to_owned(),
        step: "recording the copy's progress",
        detail: e.to_string(),
    };
    local
        .batch_execute("BEGIN; SET LOCAL synchronous_commit = on")
        .await
        .map_err(err)?;
    let upsert = "INSERT INTO mm.apply_progress (origin, remote_lsn) VALUES ($1, $2::text::pg_lsn) \
                  ON CONFLICT (origin) DO UPDATE SET remote_lsn = EXCLUDED.remote_lsn, \
                  remote_commit_ts = NULL, watermark = NULL";
    let own = names::origin_name(me);
    let src_origin = names::origin_name(source);
    for (origin, lsn) in progress {
        if *origin == own || *origin == src_origin {
            continue;
        }
        local.execute(upsert, &[origin, lsn]).await.map_err(err)?;
    }
    local
        .execute(upsert, &[&src_origin, &c_s.to_string()])
        .await
        .map_err(err)?;
    local
        .batch_execute("UPDATE mm.sync_state SET phase = 'done', finished_at = now(); COMMIT")
        .await
        .map_err(err)?;
    Ok(())
}
