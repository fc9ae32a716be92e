//! Pipelined execution of statements on the apply session, across
//! transactions.
//!
//! Every statement is sent as soon as it is queued (without waiting for the
//! previous reply) and replies are consumed in order, so neither a round trip
//! per statement nor one per transaction limits throughput. The in-flight
//! window bounds memory.
//!
//! Invariant (commit order, nothing skipped): transactions are still applied
//! one after another on one session, in the publisher's commit order. If one
//! fails, the ones queued behind it must not commit: each transaction's
//! progress guard (`sql::advance_progress`) only succeeds when the stored
//! progress is exactly the previous transaction's end, so a transaction whose
//! predecessor rolled back fails too, and the first failure is reported.
//!
//! Two transports carry the statements. The pipeline has a session of its
//! own (`mm_proto::client::PipelinedSession`) that sends a Sync only when
//! replies are waited for: one ReadyForQuery and one socket flush per
//! batch instead of per statement, which was as costly as a single-row
//! transaction itself. Every transaction sends its own BEGIN/COMMIT (a
//! single-statement one gets them here, `push_raw`), so a batch is never
//! one implicit transaction. Without that session (a DSN option only
//! tokio-postgres knows) statements go over tokio-postgres, one Sync each.
//!
//! Invariant (apply lanes, `lanes.rs`): a lane's session writes each
//! transaction as soon as its COMMIT is queued (`Pipeline::eager`), since
//! other lanes wait in the server for its commits; the agent may wait for
//! any one lane's replies, and a COMMIT left in a buffer meanwhile would
//! never run.
//!
//! Invariant (origin): a session writes replicated rows only while it holds
//! the stream's replication origin. The pipelined session holds it while
//! it applies; the careful path (`careful/`) applies on the client
//! session and takes it over first (`give_origin`), and the next pushed
//! statement takes it back. A commit without it fails anyway:
//! `pg_replication_origin_xact_setup` in every transaction's progress
//! statement needs a bound origin.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use futures_util::StreamExt;
use futures_util::stream::FuturesOrdered;
use mm_proto::client::{PipelinedSession, Reply};
use sync_wrapper::SyncWrapper;
use tokio_postgres::{Client, Statement};

use super::{ApplyFailure, Param, TxnMeta};

/// A statement the pipeline runs: its text, its name on the pipelined
/// session (parsed there on first use), and its prepared form on the
/// client session where it runs there.
#[derive(Clone)]
pub struct Stmt(Arc<StmtInner>);

struct StmtInner {
    text: Arc<str>,
    name: String,
    client: Option<Statement>,
}

impl std::fmt::Debug for Stmt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Stmt").field(&self.0.name).finish()
    }
}

impl Stmt {
    /// A statement prepared on the client session (`client`), usable on
    /// either transport.
    pub fn prepared(text: &str, client: Statement, name: String) -> Stmt {
        Stmt(Arc::new(StmtInner {
            text: Arc::from(text),
            name,
            client: Some(client),
        }))
    }

    /// Its prepared form on the client session.
    pub fn on_client(&self) -> Result<&Statement, ApplyFailure> {
        self.0.client.as_ref().ok_or_else(|| {
            ApplyFailure::new(
                None,
                "internal: statement not prepared on the client session",
            )
        })
    }
}

/// Names statements on the pipelined session: unique per session.
#[derive(Default)]
pub struct StmtNames(std::sync::atomic::AtomicU64);

impl StmtNames {
    pub fn next(&self) -> String {
        format!(
            "mm_{}",
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    Control,
    Insert,
    Update,
    /// An UPDATE that settles its own conflict (`sql::fast_update_in_place`):
    /// its first column is the conflicts it logged.
    UpdateInPlace,
    Delete,
    Truncate,
    /// An orphan check (`fk.rs`): its row count is the orphans it logged.
    OrphanCheck,
    /// The transaction's COMMIT: when it succeeds, the transaction is done.
    Commit,
    /// A batch procedure's CALL (`batch.rs`): every transaction of the
    /// batch commits on its own inside it; when it succeeds, all are done.
    Call,
}

#[derive(Debug, Clone)]
pub struct OpMeta {
    pub kind: OpKind,
    pub relation: Option<Arc<str>>,
    pub txn: TxnMeta,
    /// Rows a row statement changes when it succeeds (fast-path statements
    /// fail unless they change exactly these).
    pub rows: u64,
    /// Its success commits the transaction: COMMIT, or a row statement that
    /// is a whole transaction by itself (`sql::Commit::Fused`).
    pub commits: bool,
}

/// Rows in flight before `push` waits for replies: enough 1000-row INSERTs
/// to keep the apply backend busy, few enough that memory stays flat in
/// transaction size.
const ROW_WINDOW: u64 = 20_000;

type OpFuture = Pin<Box<dyn Future<Output = (OpMeta, Result<u64, tokio_postgres::Error>)> + Send>>;

/// A remote transaction whose local commit succeeded.
#[derive(Debug)]
pub struct Done {
    pub meta: TxnMeta,
    pub rows: u64,
    /// (conflict type, relation) of every true conflict it resolved; all of
    /// them are also rows of `mm.conflict_log` committed with it.
    pub conflicts: Vec<(&'static str, Arc<str>)>,
    /// Changes to rows last written by another origin that were routine
    /// (the publisher had seen that version), resolved without a resolver.
    pub routine: u64,
    /// Applied on the careful path after its fast-path attempt met a
    /// conflict and was rolled back.
    pub rolled_back: bool,
    /// Conflicts settled inside a fast-path statement (also in `conflicts`).
    pub in_place: u64,
}

/// The pipelined session and what it owes.
struct Raw {
    session: PipelinedSession,
    /// Metadata of the statements sent and not answered, in order.
    ops: VecDeque<OpMeta>,
    /// Statements parsed on the session, by text: a statement rebuilt
    /// with the same text (a relation's cache is rebuilt on every RELATION
    /// message) reuses the server's, which is never closed otherwise.
    parsed: HashMap<Arc<str>, String>,
    /// Why the session cannot be trusted any more (a failure it could not
    /// be brought back from): every later use fails, and the stream
    /// restarts with a new one.
    broken: Option<String>,
    /// `BLOCK` as statement texts.
    block: [Arc<str>; 2],
    /// The replication origin it binds while it holds it.
    origin: String,
    holds_origin: bool,
    /// Each transaction is written once its COMMIT is pushed
    /// (`Pipeline::eager`).
    eager: bool,
    /// Batch procedures created on the session (`batch.rs`), temporary
    /// (they go with it), by signature and body: their names, or None for
    /// one the server refused (that shape goes one statement each).
    procs: HashMap<Arc<str>, Option<String>>,
}

/// Batch procedures one session may create: one per shape of transaction
/// (its tables and kinds of change), more as relations are described
/// again. Past it, transactions go one statement each.
const MAX_PROCS: usize = 256;

/// Why a batch procedure could not be created that holds for every shape
/// alike: insufficient_privilege (no TEMPORARY privilege on the database)
/// and undefined_object (no PL/pgSQL; the signature's types are all
/// built in, and the body's casts to the tables' types are resolved only
/// when it runs).
const SESSION_WIDE: [&str; 2] = ["42501", "42704"];

/// The transaction block a fused statement gets on the pipelined session:
/// statement names, which are their text too.
const BLOCK: [&str; 2] = ["BEGIN", "COMMIT"];

fn raw_err(relation: Option<&str>) -> impl Fn(mm_proto::client::ClientError) -> ApplyFailure + '_ {
    move |e| ApplyFailure::new(relation, format!("local PostgreSQL (apply session): {e}"))
}

impl Raw {
    /// After a failure (`failed`: one was returned since the last drain):
    /// reads what is owed, rolls back the open block and, if anything
    /// failed or was skipped, deallocates every statement (a Parse the
    /// server skipped is not there; one it ran must not be parsed twice).
    /// Err: the session is not back at an idle, known state.
    async fn reset(&mut self, failed: bool) -> Result<(), String> {
        let replies = self.session.finish().await.map_err(|e| e.to_string())?;
        let failed = failed
            || self.session.status() == b'E'
            || replies.iter().any(|r| !matches!(r, Reply::Done { .. }));
        if self.session.status() != b'I' {
            self.session
                .query("ROLLBACK", &[])
                .await
                .map_err(|e| format!("ROLLBACK: {e}"))?;
        }
        if failed {
            self.session
                .query("DEALLOCATE ALL", &[])
                .await
                .map_err(|e| format!("DEALLOCATE ALL: {e}"))?;
            self.parsed.clear();
        }
        if self.session.status() != b'I' {
            return Err("still in a transaction block after ROLLBACK".to_owned());
        }
        Ok(())
    }

    /// Queues one statement (parsed first if the session lacks it).
    fn exec(
        &mut self,
        name: &str,
        text: &Arc<str>,
        params: &[Param],
        meta: OpMeta,
    ) -> Result<(), ApplyFailure> {
        let rel = meta.relation.clone();
        let err = raw_err(rel.as_deref());
        if let Some(why) = &self.broken {
            return Err(ApplyFailure::new(rel.as_deref(), why.clone()));
        }
        let name = match self.parsed.get(text) {
            Some(n) => n.as_str(),
            None => {
                self.session.parse(name, text).map_err(&err)?;
                self.parsed.insert(Arc::clone(text), name.to_owned());
                name
            }
        };
        self.session
            .execute(name, params.iter().map(Param::wire))
            .map_err(&err)?;
        self.ops.push_back(meta);
        Ok(())
    }
}

pub struct Pipeline {
    client: Arc<Client>,
    /// Only ever touched through `&mut self`; the wrapper makes the applier
    /// `Sync` so the careful path can borrow it across awaits.
    inflight: SyncWrapper<FuturesOrdered<OpFuture>>,
    /// With one lane: the pipelined session, used instead of `inflight`.
    raw: Option<SyncWrapper<Box<Raw>>>,
    /// Statements in flight (on either transport), readable through `&self`.
    count: usize,
    window: usize,
    /// Rows of the row statements in flight: their parameters are held
    /// until answered. The statement window alone let a 1M-row transaction
    /// in 1000-row INSERTs be in flight whole (agent RSS 58 -> 212 MB).
    rows_in_flight: u64,
    rows: u64,
    /// Conflicts logged by fast-path statements of the transaction being
    /// settled (orphans, conflicts settled in place), by relation.
    logged: Vec<(&'static str, Arc<str>)>,
    in_place: u64,
    pub done: VecDeque<Done>,
    /// The gate (`gate.rs`), held shared by every queued transaction (by
    /// end LSN) until its commit's reply is read or the pipeline drained.
    guards: VecDeque<(mm_proto::Lsn, super::gate::Shared)>,
    /// `settle` returned a failure and the pipeline was not drained since:
    /// the replies after it must not be read as successes (a COMMIT of an
    /// aborted transaction answers like one).
    failed: bool,
    /// Transactions queued in a group (`group.rs`) before its last one:
    /// the group's COMMIT finishes each of them too. A batch (`batch.rs`)
    /// has all of its own here, its last one included.
    grouped: VecDeque<TxnMeta>,
    /// The `mm.apply_progress` row batches record progress in: after a
    /// failure, it says which of a batch's transactions committed.
    progress_origin: Option<String>,
    /// Batch procedures can be used (`batches`): a pipelined session of
    /// one lane, whose procedures could be created so far (not, say,
    /// without the TEMPORARY privilege).
    batchable: bool,
}

impl Pipeline {
    pub fn new(client: Arc<Client>, window: usize) -> Self {
        Pipeline {
            client,
            inflight: SyncWrapper::new(FuturesOrdered::new()),
            raw: None,
            count: 0,
            window,
            rows_in_flight: 0,
            rows: 0,
            logged: Vec::new(),
            in_place: 0,
            done: VecDeque::new(),
            guards: VecDeque::new(),
            failed: false,
            grouped: VecDeque::new(),
            progress_origin: None,
            batchable: false,
        }
    }

    /// `txn` commits with the next COMMIT queued after it, that of a later
    /// transaction (`group.rs`): done when that one is.
    pub fn grouped(&mut self, txn: TxnMeta) {
        self.grouped.push_back(txn);
    }

    /// Applies on `session` from now on (one Sync per batch, see the module
    /// doc). The client session holds `origin` until the first statement.
    pub fn with_session(mut self, session: PipelinedSession, origin: &str) -> Self {
        self.raw = Some(SyncWrapper::new(Box::new(Raw {
            session,
            ops: VecDeque::new(),
            parsed: HashMap::new(),
            broken: None,
            block: BLOCK.map(Arc::from),
            origin: origin.to_owned(),
            holds_origin: false,
            eager: false,
            procs: HashMap::new(),
        })));
        self.batchable = true;
        self
    }

    /// Writes every transaction as soon as its COMMIT is pushed instead of
    /// batching writes: for apply lanes, whose sessions wait in the server
    /// for each other's commits. A lane's COMMIT left in this buffer while
    /// the agent waits for another lane's reply, and that lane waits for
    /// the COMMIT, would never end; so would a lane's token (`lanes.rs`)
    /// that the transaction left in the buffer lets go of. Replies are
    /// still read one Sync per batch.
    pub fn eager(mut self) -> Self {
        if let Some(raw) = self.raw.as_mut() {
            raw.get_mut().eager = true;
        }
        self.batchable = false;
        self
    }

    pub fn is_pipelined(&self) -> bool {
        self.raw.is_some()
    }

    /// A statement for this pipeline: prepared on the client session now
    /// (after what is in flight: a prepare waits for its reply, and replies
    /// arrive in order), or, on the pipelined session, parsed with its
    /// first use, without a round trip.
    pub async fn prepare(
        &mut self,
        names: &StmtNames,
        display: &str,
        text: &str,
    ) -> Result<Stmt, ApplyFailure> {
        let name = names.next();
        if self.raw.is_some() {
            return Ok(Stmt(Arc::new(StmtInner {
                text: Arc::from(text),
                name,
                client: None,
            })));
        }
        self.settle(0).await?;
        let s = self
            .client
            .prepare(text)
            .await
            .map_err(|e| ApplyFailure::from_pg(Some(display), &e))?;
        Ok(Stmt::prepared(text, s, name))
    }

    /// Hands the replication origin to the client session, for a careful
    /// transaction there. Everything queued before it commits first (it is
    /// earlier in commit order).
    pub async fn give_origin(&mut self) -> Result<(), ApplyFailure> {
        if !self.raw.as_mut().is_some_and(|r| r.get_mut().holds_origin) {
            return Ok(());
        }
        self.settle(0).await?;
        let Some(raw) = self.raw.as_mut().map(SyncWrapper::get_mut) else {
            return Ok(());
        };
        raw.session.finish().await.map_err(raw_err(None))?;
        raw.session
            .query(
                "SELECT pg_catalog.pg_replication_origin_session_reset()",
                &[],
            )
            .await
            .map_err(raw_err(None))?;
        raw.holds_origin = false;
        crate::pg::setup_origin(&self.client, &raw.origin)
            .await
            .map_err(|e| ApplyFailure::from_pg(None, &e))
    }

    /// Takes the origin back from the client session (idle then: the
    /// careful transaction that had it is over).
    async fn take_origin(&mut self) -> Result<(), ApplyFailure> {
        let Some(raw) = self.raw.as_mut().map(SyncWrapper::get_mut) else {
            return Ok(());
        };
        if raw.holds_origin {
            return Ok(());
        }
        self.client
            .batch_execute("SELECT pg_catalog.pg_replication_origin_session_reset()")
            .await
            .map_err(|e| ApplyFailure::from_pg(None, &e))?;
        raw.session
            .query(
                "SELECT pg_catalog.pg_replication_origin_session_setup($1)",
                &[Some(&raw.origin)],
            )
            .await
            .map_err(|e| {
                ApplyFailure::new(
                    None,
                    format!(
                        "cannot bind replication origin {} to the apply session: {e}",
                        raw.origin
                    ),
                )
            })?;
        raw.holds_origin = true;
        Ok(())
    }

    /// Writes the statements queued on the pipelined session once the
    /// oldest waited long enough (`PipelinedSession::send_some`). The
    /// stream calls this before each message: while it keeps reading it
    /// never waits for replies, which is otherwise what writes them.
    pub async fn send_queued(&mut self) -> Result<(), ApplyFailure> {
        match self.raw.as_mut().map(SyncWrapper::get_mut) {
            Some(raw) => raw.session.send_some().await.map_err(raw_err(None)),
            None => Ok(()),
        }
    }

    /// Runs one statement on the pipelined session, idle (after `settle(0)`),
    /// returning its rows in text.
    pub async fn query(&mut self, text: &str) -> Result<Vec<Vec<Option<String>>>, ApplyFailure> {
        let Some(raw) = self.raw.as_mut().map(SyncWrapper::get_mut) else {
            return Err(ApplyFailure::new(None, "internal: no pipelined session"));
        };
        raw.session.finish().await.map_err(raw_err(None))?;
        raw.session.query(text, &[]).await.map_err(raw_err(None))
    }

    pub fn failed(&self) -> bool {
        self.failed
    }

    /// Whether batch procedures can be used: a pipelined session of one
    /// lane whose procedures could be created so far.
    pub fn batches(&self) -> bool {
        self.batchable
    }

    /// The name of the batch procedure with signature and body `def`
    /// (`sql::batch_procedure`) for transactions into `relation`, created
    /// on the session first if it lacks it (which waits for everything in
    /// flight). None: this shape goes one statement each, because the
    /// server refused its procedure (the reason is logged once, naming the
    /// table), or batches are off for the session (`SESSION_WIDE`, or
    /// `MAX_PROCS` shapes seen).
    ///
    /// A refusal turns off this shape only: one bad procedure (say, a
    /// shape a later server version rejects) must not cost every other
    /// table its batches. One that would refuse every shape turns them all
    /// off, instead of trying once per shape. An error that breaks the
    /// session is the stream's.
    pub async fn procedure(
        &mut self,
        def: &str,
        relation: &str,
    ) -> Result<Option<String>, ApplyFailure> {
        if let Some(known) = self
            .raw
            .as_mut()
            .map(SyncWrapper::get_mut)
            .and_then(|r| r.procs.get(def))
        {
            return Ok(known.clone());
        }
        if !self.batches() {
            return Ok(None);
        }
        self.settle(0).await?;
        let Some(raw) = self.raw.as_mut().map(SyncWrapper::get_mut) else {
            return Ok(None);
        };
        if raw.procs.len() >= MAX_PROCS {
            return Ok(None);
        }
        raw.session.finish().await.map_err(raw_err(None))?;
        let name = format!("pg_temp.mm_batch_{}", raw.procs.len());
        let created = match raw
            .session
            .query(&format!("CREATE OR REPLACE PROCEDURE {name}{def}"), &[])
            .await
        {
            Ok(_) => Some(name),
            Err(e) if e.is_fatal() => return Err(raw_err(Some(relation))(e)),
            Err(e) if e.code().is_some_and(|c| SESSION_WIDE.contains(&c)) => {
                tracing::warn!(error = %e, "cannot create batch procedures on the apply session: transactions are applied one statement each");
                self.batchable = false;
                return Ok(None);
            }
            Err(e) => {
                tracing::warn!(error = %e, relation, "cannot create the batch procedure for transactions into this table: they are applied one statement each");
                None
            }
        };
        raw.procs.insert(Arc::from(def), created.clone());
        Ok(created)
    }

    /// Queues the CALL of a batch procedure applying `txns` (in commit
    /// order), each committing on its own inside it, after a Sync: a
    /// procedure may only commit when its CALL begins outside any
    /// transaction block. `origin`: the progress row they record in.
    pub async fn push_call(
        &mut self,
        stmt: &Stmt,
        params: &[Param],
        txns: &[TxnMeta],
        relation: Arc<str>,
        origin: &str,
    ) -> Result<(), ApplyFailure> {
        let Some(last) = txns.last().copied() else {
            return Ok(());
        };
        self.take_origin().await?;
        let rows = u64::try_from(txns.len()).unwrap_or(u64::MAX);
        let Some(raw) = self.raw.as_mut().map(SyncWrapper::get_mut) else {
            return Err(ApplyFailure::new(None, "internal: no pipelined session"));
        };
        raw.session.end_batch();
        let meta = OpMeta {
            kind: OpKind::Call,
            relation: Some(relation),
            txn: last,
            rows,
            commits: true,
        };
        raw.exec(&stmt.0.name, &stmt.0.text, params, meta)?;
        self.count = raw.ops.len();
        self.grouped.extend(txns.iter().copied());
        self.progress_origin = Some(origin.to_owned());
        self.rows_in_flight += rows;
        if self.count > self.window {
            self.settle(self.window / 2).await?;
        }
        while self.rows_in_flight > ROW_WINDOW && self.count > 0 {
            self.settle(self.count - 1).await?;
        }
        Ok(())
    }

    /// After a failure, on an idle session: the transactions of batches
    /// that committed before it (their procedure commits each on its
    /// own), as the progress row says, are done.
    async fn batch_commits(&mut self) {
        let Some(origin) = self.progress_origin.clone() else {
            return;
        };
        let Some(raw) = self.raw.as_mut().map(SyncWrapper::get_mut) else {
            return;
        };
        if raw.broken.is_some() || self.grouped.is_empty() {
            return;
        }
        let at = match raw
            .session
            .query(
                "SELECT remote_lsn::text FROM mm.apply_progress WHERE origin = $1",
                &[Some(&origin)],
            )
            .await
        {
            Ok(rows) => rows
                .first()
                .and_then(|r| r.first().cloned().flatten())
                .and_then(|t| t.parse::<mm_proto::Lsn>().ok()),
            Err(e) => {
                raw.broken = Some(format!("reading apply progress after a failure: {e}"));
                None
            }
        };
        let Some(at) = at else {
            return;
        };
        while let Some(m) = self.grouped.front().filter(|m| m.end_lsn <= at) {
            let meta = *m;
            self.grouped.pop_front();
            self.done.push_back(Done {
                meta,
                rows: 1,
                conflicts: Vec::new(),
                routine: 0,
                rolled_back: false,
                in_place: 0,
            });
        }
    }

    /// Holds `guard` until the transaction ending at `end` has committed
    /// (or the pipeline is drained).
    pub fn hold(&mut self, end: mm_proto::Lsn, guard: super::gate::Shared) {
        self.guards.push_back((end, guard));
    }

    /// The last transaction held for learned its end LSN (it was held
    /// while it still arrived, `early.rs`, under `Lsn::MAX`, which keeps it
    /// held through the commits of those before it).
    pub fn rekey_last(&mut self, end: mm_proto::Lsn) {
        if let Some((l, _)) = self.guards.back_mut() {
            *l = end;
        }
    }

    /// Lets go of the gate for every transaction up to `end`.
    fn release(&mut self, end: mm_proto::Lsn) {
        while self.guards.front().is_some_and(|(l, _)| *l <= end) {
            self.guards.pop_front();
        }
    }

    /// Lets go of the gate entirely: nothing queued is uncommitted.
    pub fn release_all(&mut self) {
        self.guards.clear();
    }

    /// Queues and SENDS a statement. The first poll of a tokio-postgres query
    /// future enqueues its protocol messages on the connection; polling it here,
    /// once, fixes the send order to the queue order regardless of when the
    /// ordered set is polled next. On the pipelined session the statement is
    /// queued in its send buffer, written once enough is waiting or when
    /// replies are waited for (`settle`).
    pub async fn push(
        &mut self,
        stmt: &Stmt,
        params: Vec<Param>,
        meta: OpMeta,
    ) -> Result<(), ApplyFailure> {
        self.rows_in_flight += meta.rows;
        if self.raw.is_some() {
            self.push_raw(stmt, &params, meta).await?;
        } else {
            self.push_client(stmt, params, meta)?;
        }
        if self.count > self.window {
            self.settle(self.window / 2).await?;
        }
        if self.rows_in_flight > ROW_WINDOW {
            while self.rows_in_flight > ROW_WINDOW / 2 && self.count > 0 {
                self.settle(self.count - 1).await?;
            }
        }
        Ok(())
    }

    /// Queues `stmt` (no parameters) to run whatever failed before it:
    /// on the pipelined session after a Sync (the server skips to one
    /// after an error), and written at once. Lanes let go of their tokens
    /// with it (`lanes.rs`), which another lane may be waiting for while
    /// this one is idle after a failure. Not bounded by the window: this
    /// must not wait for replies.
    pub async fn push_after_failure(
        &mut self,
        stmt: &Stmt,
        meta: OpMeta,
    ) -> Result<(), ApplyFailure> {
        let Some(raw) = self.raw.as_mut().map(SyncWrapper::get_mut) else {
            return self.push_client(stmt, Vec::new(), meta);
        };
        raw.session.sync().await.map_err(raw_err(None))?;
        raw.exec(&stmt.0.name, &stmt.0.text, &[], meta)?;
        self.count = raw.ops.len();
        raw.session.send_all().await.map_err(raw_err(None))
    }

    fn push_client(
        &mut self,
        stmt: &Stmt,
        params: Vec<Param>,
        meta: OpMeta,
    ) -> Result<(), ApplyFailure> {
        let client = Arc::clone(&self.client);
        let stmt = stmt.on_client()?.clone();
        let mut fut: OpFuture = if meta.kind == OpKind::UpdateInPlace {
            Box::pin(async move {
                let r = logged_count(&client, &stmt, params).await;
                (meta, r)
            })
        } else {
            Box::pin(async move {
                let r = client.execute_raw(&stmt, params).await;
                (meta, r)
            })
        };
        let first = {
            let mut cx = Context::from_waker(Waker::noop());
            fut.as_mut().poll(&mut cx)
        };
        match first {
            Poll::Ready(out) => self
                .inflight
                .get_mut()
                .push_back(Box::pin(std::future::ready(out)) as OpFuture),
            Poll::Pending => self.inflight.get_mut().push_back(fut),
        }
        self.count = self.inflight.get_mut().len();
        Ok(())
    }

    /// A statement that is its whole transaction (`sql::Commit::Fused`)
    /// goes out between a BEGIN and a COMMIT of its own here: without a
    /// Sync after it, it would share one implicit transaction (and one
    /// commit timestamp) with the statements after it. Its COMMIT is then
    /// what finishes the transaction.
    async fn push_raw(
        &mut self,
        stmt: &Stmt,
        params: &[Param],
        mut meta: OpMeta,
    ) -> Result<(), ApplyFailure> {
        self.take_origin().await?;
        let ends_txn = meta.commits;
        let fused = meta.commits && meta.kind != OpKind::Commit;
        let Some(raw) = self.raw.as_mut().map(SyncWrapper::get_mut) else {
            return Err(ApplyFailure::new(None, "internal: no pipelined session"));
        };
        if fused {
            let begin = OpMeta {
                kind: OpKind::Control,
                rows: 0,
                commits: false,
                ..meta.clone()
            };
            let [begin_text, commit_text] = raw.block.clone();
            raw.exec(BLOCK[0], &begin_text, &[], begin)?;
            meta.commits = false;
            let commit = OpMeta {
                kind: OpKind::Commit,
                rows: 0,
                commits: true,
                ..meta.clone()
            };
            raw.exec(&stmt.0.name, &stmt.0.text, params, meta)?;
            raw.exec(BLOCK[1], &commit_text, &[], commit)?;
        } else {
            raw.exec(&stmt.0.name, &stmt.0.text, params, meta)?;
        }
        self.count = raw.ops.len();
        if raw.eager && ends_txn {
            raw.session.send_all().await.map_err(raw_err(None))
        } else {
            raw.session.send_some().await.map_err(raw_err(None))
        }
    }

    /// The next reply, on whichever transport: rows changed (or, for
    /// `UpdateInPlace`, conflicts logged), or the failure.
    async fn next_reply(&mut self) -> Option<(OpMeta, Result<u64, ApplyFailure>)> {
        let Some(raw) = self.raw.as_mut().map(SyncWrapper::get_mut) else {
            let (meta, res) = self.inflight.get_mut().next().await?;
            let res = res.map_err(|e| ApplyFailure::from_pg(meta.relation.as_deref(), &e));
            return Some((meta, res));
        };
        if raw.ops.is_empty() {
            return None;
        }
        let reply = raw.session.next_reply().await;
        let meta = raw.ops.pop_front()?;
        let rel = meta.relation.as_deref();
        let res = match reply {
            Ok(Reply::Done { first_sum, .. }) if meta.kind == OpKind::UpdateInPlace => {
                Ok(u64::try_from(first_sum).unwrap_or(0))
            }
            Ok(Reply::Done { rows, .. }) => Ok(rows),
            Ok(Reply::Failed(e)) => Err(ApplyFailure::from_server(rel, &e)),
            Ok(Reply::Skipped) => Err(ApplyFailure::new(
                rel,
                "not run: an earlier statement of its batch failed",
            )),
            Err(e) => Err(raw_err(rel)(e)),
        };
        Some((meta, res))
    }

    /// Waits until at most `keep` statements are in flight. The first failure
    /// is returned with the transaction it belongs to; the session is
    /// discarded after a failure, so later replies are not waited for.
    pub async fn settle(&mut self, keep: usize) -> Result<(), ApplyFailure> {
        while self.count > keep {
            let next = self.next_reply().await;
            self.count = match self.raw.as_mut() {
                Some(r) => r.get_mut().ops.len(),
                None => self.inflight.get_mut().len(),
            };
            let Some((meta, res)) = next else {
                break;
            };
            self.rows_in_flight = self.rows_in_flight.saturating_sub(meta.rows);
            match res {
                Ok(n) if meta.kind == OpKind::OrphanCheck => {
                    if n > 0
                        && let Some(rel) = &meta.relation
                    {
                        super::fk::warn_orphans(rel, n, meta.txn.commit_lsn);
                        for _ in 0..n {
                            self.logged.push((super::fk::ORPHAN, Arc::clone(rel)));
                        }
                    }
                }
                Ok(n) if meta.kind == OpKind::UpdateInPlace => {
                    self.rows += meta.rows;
                    if let Some(rel) = &meta.relation {
                        for _ in 0..n {
                            self.logged.push((
                                crate::conflict::ConflictType::UpdateOriginDiffers.as_str(),
                                Arc::clone(rel),
                            ));
                        }
                    }
                    self.in_place += n;
                    if meta.commits {
                        self.finish(meta.txn);
                    }
                }
                Ok(_) => {
                    // Fast-path row statements fail unless they change every
                    // row; success means they changed exactly `meta.rows`.
                    if matches!(
                        meta.kind,
                        OpKind::Insert | OpKind::Update | OpKind::Delete | OpKind::Call
                    ) {
                        self.rows += meta.rows;
                    }
                    if meta.commits {
                        self.finish(meta.txn);
                    }
                }
                Err(mut f) => {
                    f.txn = Some(meta.txn);
                    // A fast-path row statement refused (MM001) or hit a
                    // unique key: the transaction needs the resolver.
                    f.conflict = matches!(
                        meta.kind,
                        OpKind::Insert | OpKind::Update | OpKind::UpdateInPlace | OpKind::Delete
                    ) && f.signal.is_some();
                    // Inside a group (`group.rs`) the statement may be
                    // several transactions' (merged inserts), and an error
                    // must name the one that failed: its transactions are
                    // applied again one at a time (`recover`), where it
                    // fails alone, under its own commit LSN.
                    if !self.grouped.is_empty() && f.sqlstate.is_some() {
                        f.conflict = true;
                    }
                    // A batch's failure is its first uncommitted
                    // transaction's; which one that is, the progress row
                    // says once the session is drained (`batch_commits`).
                    // Named the first, `recover` starts at the first
                    // uncommitted one whichever it is.
                    if meta.kind == OpKind::Call
                        && let Some(first) = self.grouped.front()
                    {
                        f.txn = Some(*first);
                    }
                    self.rows = 0;
                    self.logged.clear();
                    self.in_place = 0;
                    self.failed = true;
                    return Err(f);
                }
            }
        }
        Ok(())
    }

    /// The transaction whose commit just succeeded is done.
    fn finish(&mut self, txn: TxnMeta) {
        self.release(txn.end_lsn);
        // A group's transactions before its last: each is done (status
        // and wait-sync count transactions); its rows and conflicts are
        // reported with the last (a batch's last is here too: not twice).
        while let Some(m) = self.grouped.front().filter(|m| m.end_lsn <= txn.end_lsn) {
            let meta = *m;
            self.grouped.pop_front();
            if meta.end_lsn == txn.end_lsn {
                continue;
            }
            self.done.push_back(Done {
                meta,
                rows: 0,
                conflicts: Vec::new(),
                routine: 0,
                rolled_back: false,
                in_place: 0,
            });
        }
        self.done.push_back(Done {
            meta: txn,
            rows: std::mem::take(&mut self.rows),
            conflicts: std::mem::take(&mut self.logged),
            routine: 0,
            rolled_back: false,
            in_place: std::mem::take(&mut self.in_place),
        });
    }

    pub fn in_flight(&self) -> usize {
        self.count
    }

    /// Whether the stream should read more now: the apply backend has less
    /// than a quarter of either window left to work on. Reading while it
    /// still has plenty only moves the backlog from the socket into memory,
    /// and a reader that drains the socket as fast as the walsender fills
    /// it is woken per message, and makes the walsender send per message:
    /// on 2 cores that cost the agent and the walsender twice their CPU
    /// in some backlog runs, and the catch-up 40% of its speed.
    pub fn wants_more(&self) -> bool {
        self.count < self.window / 4 && self.rows_in_flight < ROW_WINDOW / 4
    }

    /// After a failure: waits out every statement still in flight, ignoring
    /// their results (they all belong to transactions that roll back: the
    /// failed one, and those queued behind it, whose progress guard fails).
    ///
    /// On the pipelined session the transaction block left open (failed,
    /// or a transaction queued only in part) is rolled back here, and its
    /// statements are deallocated: a Parse the server skipped after the
    /// failure is not there, and one it ran must not be parsed twice.
    pub async fn drain(&mut self) {
        while self.inflight.get_mut().next().await.is_some() {}
        let failed = self.failed;
        if let Some(raw) = self.raw.as_mut().map(SyncWrapper::get_mut) {
            raw.ops.clear();
            if let Err(why) = raw.reset(failed).await {
                tracing::warn!(error = %why, "apply session unusable after a failure");
                raw.broken = Some(why);
            }
        }
        self.batch_commits().await;
        self.failed = false;
        self.guards.clear();
        self.grouped.clear();
        self.count = 0;
        self.rows_in_flight = 0;
        self.rows = 0;
        self.logged.clear();
        self.in_place = 0;
    }
}

/// Runs a resolving UPDATE: its first column is the conflicts it logged.
async fn logged_count(
    client: &Client,
    stmt: &Statement,
    params: Vec<Param>,
) -> Result<u64, tokio_postgres::Error> {
    let rows = client.query_raw(stmt, params).await?;
    futures_util::pin_mut!(rows);
    let mut n = 0u64;
    while let Some(row) = futures_util::TryStreamExt::try_next(&mut rows).await? {
        let logged: i32 = row.try_get(0)?;
        n += u64::try_from(logged).unwrap_or(0);
    }
    Ok(n)
}
