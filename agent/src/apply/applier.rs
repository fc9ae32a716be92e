//! Applies remote transactions to the local node. See the module docs of
//! `apply` for the invariants this file enforces.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use mm_proto::Lsn;
use mm_proto::pgoutput::{
    ColumnValue, Delete, Insert, KeyValue, Message, OldTuple, PgTimestamp, Truncate, TupleData,
    Update,
};
use tokio_postgres::{Client, Statement};

use super::pipeline::{Done, OpKind, OpMeta, Pipeline};
use super::relation::LocalRelation;
use super::sql::{self, Locator};
use super::{ApplyFailure, Param};

/// Statements in flight per transaction before we wait for replies.
const PIPELINE_WINDOW: usize = 2048;
/// Rows per multi-row INSERT for runs of inserts into one table.
const INSERT_BATCH: usize = 100;
/// PostgreSQL's limit on bind parameters per statement.
const MAX_PARAMS: usize = 65535;

/// Identity of the remote transaction being applied.
#[derive(Debug, Clone, Copy)]
pub struct TxnMeta {
    pub xid: u32,
    pub commit_lsn: Lsn,
    /// Stored as the applied progress: START_REPLICATION resumes from it.
    pub end_lsn: Lsn,
    pub commit_ts: PgTimestamp,
}

/// Where a transaction's messages come from: memory for ordinary transactions,
/// the spool file for streamed ones.
pub trait ChangeSource: Send {
    fn next_message(&mut self) -> Result<Option<Message>, ApplyFailure>;
}

impl ChangeSource for std::vec::IntoIter<Message> {
    fn next_message(&mut self) -> Result<Option<Message>, ApplyFailure> {
        Ok(self.next())
    }
}

pub struct Applier {
    client: Arc<Client>,
    origin: String,
    relations: HashMap<u32, LocalRelation>,
    begin: Statement,
    advance: Statement,
    commit: Statement,
    /// Statements sent and not yet answered, across transactions.
    pipe: Option<Pipeline>,
    /// The progress the next queued transaction expects to find stored:
    /// the end of the transaction queued before it.
    next_expected: Lsn,
    wal_positions: Statement,
    /// End LSN of the last remote transaction committed here.
    last_applied: Lsn,
    /// (remote position applied, local WAL insert position when it was
    /// sampled): once local WAL is flushed past the second, the first is durable.
    unflushed: VecDeque<(Lsn, Lsn)>,
    durable: Lsn,
}

fn value(v: &ColumnValue, rel: &str, col: &str) -> Result<Param, ApplyFailure> {
    match v {
        ColumnValue::Null => Ok(Param::Null),
        ColumnValue::Text(b) => Ok(Param::Text(b.clone())),
        ColumnValue::Binary(_) => Err(ApplyFailure::new(
            Some(rel),
            format!(
                "column \"{col}\" arrived in binary format, which this stream did not negotiate"
            ),
        )),
        ColumnValue::UnchangedToast => Err(ApplyFailure::new(
            Some(rel),
            format!("column \"{col}\" arrived as 'unchanged TOAST' where a full value is required"),
        )),
    }
}

fn parse_lsn(s: Option<String>, what: &str) -> Result<Lsn, ApplyFailure> {
    match s {
        None => Ok(Lsn::INVALID),
        Some(s) => s
            .parse()
            .map_err(|e| ApplyFailure::new(None, format!("{what}: {e}"))),
    }
}

impl Applier {
    /// Opens the apply session for the stream from `peer`: replica role (no
    /// user triggers, no FK checks fired twice), the requested commit
    /// durability, and the peer's replication origin bound to the session (it
    /// tags our commits so they are never sent back out). Returns the stored
    /// progress: where the stream must resume.
    pub async fn open(
        dsn: &str,
        password: Option<&str>,
        origin: &str,
        synchronous_commit: &str,
    ) -> Result<(Applier, Lsn), ApplyFailure> {
        let client = crate::pg::connect(dsn, password)
            .await
            .map_err(|e| ApplyFailure::new(None, e.to_string()))?;
        let pg = |e: tokio_postgres::Error| ApplyFailure::from_pg(None, &e);
        client
            .batch_execute(&format!(
                "SET session_replication_role = replica; SET synchronous_commit = {}",
                match synchronous_commit {
                    "on" | "off" | "local" | "remote_write" | "remote_apply" => synchronous_commit,
                    _ => "off",
                }
            ))
            .await
            .map_err(pg)?;
        client
            .execute(
                "SELECT pg_catalog.pg_replication_origin_create($1) \
                 WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_replication_origin WHERE roname = $1)",
                &[&origin],
            )
            .await
            .map_err(pg)?;
        client
            .execute(
                "SELECT pg_catalog.pg_replication_origin_session_setup($1)",
                &[&origin],
            )
            .await
            .map_err(pg)?;
        client
            .execute(
                "INSERT INTO mm.apply_progress (origin, remote_lsn) VALUES ($1, '0/0') \
                 ON CONFLICT (origin) DO NOTHING",
                &[&origin],
            )
            .await
            .map_err(pg)?;
        let row = client
            .query_one(
                "SELECT remote_lsn::text FROM mm.apply_progress WHERE origin = $1",
                &[&origin],
            )
            .await
            .map_err(pg)?;
        let start = parse_lsn(row.get(0), "stored apply progress")?;
        let begin = client.prepare("BEGIN").await.map_err(pg)?;
        let commit = client.prepare("COMMIT").await.map_err(pg)?;
        // One statement records progress (only if the previous transaction's
        // is in place: see pipeline.rs) and gives the commit the remote commit
        // timestamp through the origin (schema.rs).
        let advance = client
            .prepare("SELECT mm.advance_progress($1, $2, $3, $4)")
            .await
            .map_err(pg)?;
        let wal_positions = client
            .prepare(
                "SELECT pg_catalog.pg_current_wal_insert_lsn()::text, pg_catalog.pg_current_wal_flush_lsn()::text",
            )
            .await
            .map_err(pg)?;
        let client = Arc::new(client);
        let mut applier = Applier {
            pipe: Some(Pipeline::new(Arc::clone(&client), PIPELINE_WINDOW)),
            next_expected: start,
            client,
            origin: origin.to_owned(),
            relations: HashMap::new(),
            begin,
            advance,
            commit,
            wal_positions,
            last_applied: start,
            unflushed: VecDeque::new(),
            durable: Lsn::INVALID,
        };
        // What we read is committed but, with asynchronous commit, maybe not
        // yet flushed: it only becomes durable through the same gate.
        applier.durable_progress().await?;
        Ok((applier, start))
    }

    /// The highest applied remote position whose local commit is flushed to
    /// disk: the only position we may report to the publisher as flushed.
    /// Sampling the local WAL insert position after the last commit and
    /// waiting for the flush position to pass it is the same rule as
    /// PostgreSQL's own get_flush_position, at the granularity of our ticks.
    pub async fn durable_progress(&mut self) -> Result<Lsn, ApplyFailure> {
        self.settle(0).await?;
        let row = self
            .client
            .query_one(&self.wal_positions, &[])
            .await
            .map_err(|e| ApplyFailure::from_pg(None, &e))?;
        let insert = parse_lsn(row.get(0), "pg_current_wal_insert_lsn")?;
        let flush = parse_lsn(row.get(1), "pg_current_wal_flush_lsn")?;
        if self
            .unflushed
            .back()
            .is_none_or(|(r, _)| *r < self.last_applied)
        {
            self.unflushed.push_back((self.last_applied, insert));
        }
        while let Some(&(remote, local)) = self.unflushed.front() {
            if local > flush {
                break;
            }
            self.durable = self.durable.max(remote);
            self.unflushed.pop_front();
        }
        Ok(self.durable)
    }

    /// Applies a relation description that arrived outside a transaction.
    pub async fn relation(
        &mut self,
        rel: mm_proto::pgoutput::Relation,
    ) -> Result<(), ApplyFailure> {
        let local = LocalRelation::resolve(&self.client, rel).await?;
        self.relations.insert(local.remote.oid, local);
        Ok(())
    }

    /// Queues one remote transaction as one local transaction. It is sent
    /// but not necessarily committed when this returns: finished
    /// transactions come out of `take_done`, failures out of this call or of
    /// `settle` (carrying the failed transaction).
    pub async fn apply(
        &mut self,
        meta: &TxnMeta,
        src: &mut dyn ChangeSource,
    ) -> Result<(), ApplyFailure> {
        let mut pipe = self.take_pipe()?;
        let r = self.queue(&mut pipe, meta, src).await;
        self.pipe = Some(pipe);
        r.map_err(|mut f| {
            f.txn.get_or_insert(*meta);
            f
        })?;
        self.next_expected = meta.end_lsn;
        Ok(())
    }

    async fn queue(
        &mut self,
        pipe: &mut Pipeline,
        meta: &TxnMeta,
        src: &mut dyn ChangeSource,
    ) -> Result<(), ApplyFailure> {
        let txn = *meta;
        let control = |kind| OpMeta {
            kind,
            relation: None,
            txn,
        };
        pipe.push(&self.begin.clone(), Vec::new(), control(OpKind::Control))
            .await?;
        let mut next = src.next_message()?;
        while let Some(msg) = next.take() {
            match msg {
                Message::Relation(r) => {
                    // Catalog lookups need replies before we can go on; they
                    // are rare (first use, or a schema change), so settle first.
                    pipe.settle(0).await?;
                    self.relation(r).await?;
                }
                Message::Insert(i) => {
                    // Consecutive inserts into one table go out as multi-row
                    // INSERTs: one protocol round per batch instead of per row.
                    let oid = i.relation_oid;
                    let mut batch = vec![i];
                    loop {
                        match src.next_message()? {
                            Some(Message::Insert(j))
                                if j.relation_oid == oid && batch.len() < INSERT_BATCH =>
                            {
                                batch.push(j)
                            }
                            other => {
                                next = other;
                                break;
                            }
                        }
                    }
                    self.insert_batch(pipe, txn, oid, batch).await?;
                    continue;
                }
                Message::Update(u) => self.update(pipe, txn, u).await?,
                Message::Delete(d) => self.delete(pipe, txn, d).await?,
                Message::Truncate(t) => self.truncate(pipe, txn, t).await?,
                // Types are described for binary mode; we bind text. Logical
                // messages and origins carry nothing to apply here.
                Message::Type(_) | Message::Message(_) | Message::Origin(_) => {}
                other => {
                    return Err(ApplyFailure::new(
                        None,
                        format!("unexpected message inside a transaction: {}", other.name()),
                    ));
                }
            }
            next = src.next_message()?;
        }
        pipe.push(
            &self.advance.clone(),
            vec![
                Param::text(self.origin.clone()),
                Param::text(self.next_expected.to_string()),
                Param::text(meta.end_lsn.to_string()),
                Param::text(meta.commit_ts.to_string()),
            ],
            control(OpKind::Control),
        )
        .await?;
        pipe.push(&self.commit.clone(), Vec::new(), control(OpKind::Commit))
            .await
    }

    fn take_pipe(&mut self) -> Result<Pipeline, ApplyFailure> {
        self.pipe.take().ok_or_else(|| {
            ApplyFailure::new(None, "apply session unusable after an earlier failure")
        })
    }

    /// Waits until at most `keep` statements are in flight. Cancel-safe (the
    /// stream's select loop drops it when a message arrives first): the
    /// pipeline is borrowed in place, never taken out.
    pub async fn settle(&mut self, keep: usize) -> Result<(), ApplyFailure> {
        let Some(pipe) = self.pipe.as_mut() else {
            return Err(ApplyFailure::new(
                None,
                "apply session unusable after an earlier failure",
            ));
        };
        let r = pipe.settle(keep).await;
        if let Some(d) = pipe.done.back() {
            self.last_applied = self.last_applied.max(d.meta.end_lsn);
        }
        r
    }

    /// Waits for the next reply (for an idle stream: keeps results flowing).
    pub async fn settle_next(&mut self) -> Result<(), ApplyFailure> {
        let keep = self.in_flight().saturating_sub(1);
        self.settle(keep).await
    }

    pub fn in_flight(&self) -> usize {
        self.pipe.as_ref().map_or(0, Pipeline::in_flight)
    }

    /// Transactions committed since the last call, in commit order.
    pub fn take_done(&mut self) -> Vec<Done> {
        let done: Vec<Done> = self
            .pipe
            .as_mut()
            .map(|p| p.done.drain(..).collect())
            .unwrap_or_default();
        if let Some(d) = done.last() {
            self.last_applied = self.last_applied.max(d.meta.end_lsn);
        }
        done
    }

    fn rel(&self, oid: u32) -> Result<&LocalRelation, ApplyFailure> {
        self.relations.get(&oid).ok_or_else(|| {
            ApplyFailure::new(
                None,
                format!("change for relation oid {oid} arrived before its RELATION message"),
            )
        })
    }

    fn rel_mut(&mut self, oid: u32) -> Result<&mut LocalRelation, ApplyFailure> {
        self.relations.get_mut(&oid).ok_or_else(|| {
            ApplyFailure::new(
                None,
                format!("change for relation oid {oid} arrived before its RELATION message"),
            )
        })
    }

    /// Prepares a statement needed mid-transaction. The pipeline is settled
    /// first: a prepare waits for its reply, and replies arrive in order.
    async fn prepare_settled(
        pipe: &mut Pipeline,
        client: &Client,
        display: &str,
        text: &str,
    ) -> Result<Statement, ApplyFailure> {
        pipe.settle(0).await?;
        Self::prepare(client, display, text).await
    }

    /// Takes the client, not `&self`: the pipeline's futures make `Applier`
    /// non-`Sync`, so `&Applier` must not be held across an await.
    async fn prepare(
        client: &Client,
        display: &str,
        text: &str,
    ) -> Result<Statement, ApplyFailure> {
        client
            .prepare(text)
            .await
            .map_err(|e| ApplyFailure::from_pg(Some(display), &e))
    }

    /// Inserts rows of one relation: full batches as one multi-row INSERT
    /// (a single statement per batch size keeps the cache small), the rest
    /// row by row.
    async fn insert_batch(
        &mut self,
        pipe: &mut Pipeline,
        txn: TxnMeta,
        oid: u32,
        rows: Vec<Insert>,
    ) -> Result<(), ApplyFailure> {
        let width = self.rel(oid)?.local_names.len();
        if rows.len() < INSERT_BATCH || width * INSERT_BATCH > MAX_PARAMS {
            for ins in rows {
                self.insert(pipe, txn, ins).await?;
            }
            return Ok(());
        }
        let rel = self.rel(oid)?;
        let display = Arc::clone(&rel.display);
        let mut params = Vec::with_capacity(width * rows.len());
        for ins in &rows {
            params.extend(tuple_params(&ins.new, rel, None)?);
        }
        let stmt = match &rel.insert_batch {
            Some(s) => s.clone(),
            None => {
                let cols: Vec<&str> = rel.local_names.iter().map(String::as_str).collect();
                let text = sql::insert_rows(&rel.table_sql, &cols, INSERT_BATCH);
                let s = Self::prepare_settled(pipe, &self.client, &display, &text).await?;
                self.rel_mut(oid)?.insert_batch = Some(s.clone());
                s
            }
        };
        push_row(pipe, &stmt, params, OpKind::Insert, display, txn).await
    }

    async fn insert(
        &mut self,
        pipe: &mut Pipeline,
        txn: TxnMeta,
        ins: Insert,
    ) -> Result<(), ApplyFailure> {
        let rel = self.rel(ins.relation_oid)?;
        let params = tuple_params(&ins.new, rel, None)?;
        let display = Arc::clone(&rel.display);
        let stmt = match &rel.insert {
            Some(s) => s.clone(),
            None => {
                let cols: Vec<&str> = rel.local_names.iter().map(String::as_str).collect();
                let text = sql::insert(&rel.table_sql, &cols);
                let s = Self::prepare_settled(pipe, &self.client, &display, &text).await?;
                self.rel_mut(ins.relation_oid)?.insert = Some(s.clone());
                s
            }
        };
        push_row(pipe, &stmt, params, OpKind::Insert, display, txn).await
    }

    async fn update(
        &mut self,
        pipe: &mut Pipeline,
        txn: TxnMeta,
        upd: Update,
    ) -> Result<(), ApplyFailure> {
        let rel = self.rel(upd.relation_oid)?;
        let display = Arc::clone(&rel.display);
        let set_mask: Vec<bool> = upd
            .new
            .columns
            .iter()
            .map(|c| matches!(c, ColumnValue::UnchangedToast))
            .collect();
        if set_mask.len() != rel.local_names.len() {
            return Err(column_count(rel, set_mask.len()));
        }
        let mut params = tuple_params(&upd.new, rel, Some(&set_mask))?;
        let (match_mask, match_params) = locate(rel, upd.old.as_ref(), Some(&upd.new))?;
        params.extend(match_params);
        let key = (set_mask, match_mask);
        let stmt = match rel.update.get(&key) {
            Some(s) => s.clone(),
            None => {
                let set_cols: Vec<&str> = rel
                    .local_names
                    .iter()
                    .zip(&key.0)
                    .filter(|(_, skip)| !**skip)
                    .map(|(n, _)| n.as_str())
                    .collect();
                let text = sql::update(&rel.table_sql, &set_cols, &masked_locator(rel, &key.1));
                let s = Self::prepare_settled(pipe, &self.client, &display, &text).await?;
                self.rel_mut(upd.relation_oid)?
                    .update
                    .insert(key, s.clone());
                s
            }
        };
        push_row(pipe, &stmt, params, OpKind::Update, display, txn).await
    }

    async fn delete(
        &mut self,
        pipe: &mut Pipeline,
        txn: TxnMeta,
        del: Delete,
    ) -> Result<(), ApplyFailure> {
        let rel = self.rel(del.relation_oid)?;
        let display = Arc::clone(&rel.display);
        let (match_mask, params) = locate(rel, Some(&del.old), None)?;
        let stmt = match rel.delete.get(&match_mask) {
            Some(s) => s.clone(),
            None => {
                let text = sql::delete(&rel.table_sql, &masked_locator(rel, &match_mask));
                let s = Self::prepare_settled(pipe, &self.client, &display, &text).await?;
                self.rel_mut(del.relation_oid)?
                    .delete
                    .insert(match_mask, s.clone());
                s
            }
        };
        push_row(pipe, &stmt, params, OpKind::Delete, display, txn).await
    }

    async fn truncate(
        &mut self,
        pipe: &mut Pipeline,
        txn: TxnMeta,
        t: Truncate,
    ) -> Result<(), ApplyFailure> {
        let mut tables = Vec::with_capacity(t.relation_oids.len());
        for oid in &t.relation_oids {
            tables.push(self.rel(*oid)?.table_sql.clone());
        }
        let display: Arc<str> = Arc::from(tables.join(", ").as_str());
        let text = sql::truncate(&tables, t.cascade, t.restart_identity);
        let stmt = Self::prepare_settled(pipe, &self.client, &display, &text).await?;
        push_row(pipe, &stmt, Vec::new(), OpKind::Truncate, display, txn).await
    }
}

fn column_count(rel: &LocalRelation, got: usize) -> ApplyFailure {
    ApplyFailure::new(
        Some(&*rel.display),
        format!(
            "tuple has {got} columns but the RELATION message described {}",
            rel.local_names.len()
        ),
    )
}

async fn push_row(
    pipe: &mut Pipeline,
    stmt: &Statement,
    params: Vec<Param>,
    kind: OpKind,
    relation: Arc<str>,
    txn: TxnMeta,
) -> Result<(), ApplyFailure> {
    let meta = OpMeta {
        kind,
        relation: Some(relation),
        txn,
    };
    pipe.push(stmt, params, meta).await
}

/// Parameters for every column of `tuple`, skipping those marked in `skip`.
fn tuple_params(
    tuple: &TupleData,
    rel: &LocalRelation,
    skip: Option<&[bool]>,
) -> Result<Vec<Param>, ApplyFailure> {
    if tuple.columns.len() != rel.local_names.len() {
        return Err(column_count(rel, tuple.columns.len()));
    }
    let mut out = Vec::with_capacity(tuple.columns.len());
    for (i, (v, name)) in tuple.columns.iter().zip(&rel.local_names).enumerate() {
        if skip.is_some_and(|m| m.get(i).copied().unwrap_or(false)) {
            continue;
        }
        out.push(value(v, &rel.display, name)?);
    }
    Ok(out)
}

/// The locator restricted to the columns not masked out.
fn masked_locator(rel: &LocalRelation, mask: &[bool]) -> Locator {
    match &rel.locator {
        Locator::Key(k) => Locator::Key(k.clone()),
        Locator::AllColumns(cols) => Locator::AllColumns(
            cols.iter()
                .zip(mask.iter().chain(std::iter::repeat(&false)))
                .filter(|(_, m)| !**m)
                .map(|(c, _)| c.clone())
                .collect(),
        ),
    }
}

/// Values that find the target row: the local key taken from the old tuple
/// (or, for an update that did not change the key, the new one); or, for
/// REPLICA IDENTITY FULL without a key, every column of the old row except
/// unchanged-TOAST ones. Returns (columns left out of the match, params).
fn locate(
    rel: &LocalRelation,
    old: Option<&OldTuple>,
    new: Option<&TupleData>,
) -> Result<(Vec<bool>, Vec<Param>), ApplyFailure> {
    match &rel.locator {
        Locator::Key(names) => {
            let mut params = Vec::with_capacity(rel.key_remote.len());
            for (&idx, name) in rel.key_remote.iter().zip(names) {
                let v = match old {
                    Some(OldTuple::Full(t)) => t.columns.get(idx),
                    Some(OldTuple::Key(k)) => match k.values(&rel.remote) {
                        Ok(mut vals) => match vals.nth(idx) {
                            Some(KeyValue::Key(v)) => Some(v),
                            _ => None,
                        },
                        Err(e) => {
                            return Err(ApplyFailure::new(Some(&*rel.display), e.to_string()));
                        }
                    },
                    None => new.and_then(|n| n.columns.get(idx)),
                };
                let Some(v) = v else {
                    return Err(ApplyFailure::new(
                        Some(&*rel.display),
                        format!(
                            "the publisher did not send key column \"{name}\" needed to find the row"
                        ),
                    ));
                };
                params.push(value(v, &rel.display, name)?);
            }
            Ok((Vec::new(), params))
        }
        Locator::AllColumns(_) => {
            let Some(OldTuple::Full(t)) = old else {
                return Err(ApplyFailure::new(
                    Some(&*rel.display),
                    "no local key and the publisher sent no full old row: cannot find the target row",
                ));
            };
            if t.columns.len() != rel.local_names.len() {
                return Err(column_count(rel, t.columns.len()));
            }
            let mask: Vec<bool> = t
                .columns
                .iter()
                .map(|c| matches!(c, ColumnValue::UnchangedToast))
                .collect();
            let params = tuple_params(t, rel, Some(&mask))?;
            Ok((mask, params))
        }
    }
}
