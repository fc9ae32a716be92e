//! The fast path: a remote transaction as pipelined statements (prepared
//! per relation and shape), its conflict checks folded into them, its
//! progress record and COMMIT behind them (`pipeline.rs`). A check that
//! fails raises, and `recover.rs` takes over.

use std::sync::Arc;

use mm_proto::pgoutput::{
    ColumnValue, Delete, Insert, Message, OldTuple, Truncate, TupleData, Update,
};

use super::applier::{Applier, Guard, is_partition_truncate, partition_truncate_params};
use super::pipeline::{OpKind, OpMeta, Pipeline, Stmt};
use super::relation::LocalRelation;
use super::sql::{self, Commit};
use super::tuple::{column_count, locate, masked_locator, tuple_params};
use super::txn::{ChangeSource, TxnMeta};
use super::{ApplyFailure, Param};

/// Rows per multi-row INSERT for runs of inserts into one table: large
/// statements first, then small ones, the rest row by row (`batch_sizes`).
/// Every statement costs the backend its setup and the insert's re-check
/// call, so fewer, larger statements win. The small size is for groups of
/// single-row transactions sent before they are full (`group.rs`).
pub(super) const INSERT_BATCHES: [usize; 3] = [1000, 100, 10];

/// PostgreSQL's limit on bind parameters per statement.
pub(super) const MAX_PARAMS: usize = 65535;

impl Applier {
    pub(super) async fn queue(
        &mut self,
        pipe: &mut Pipeline,
        meta: &TxnMeta,
        src: &mut dyn ChangeSource,
    ) -> Result<(), ApplyFailure> {
        self.queue_begin(pipe, meta).await?;
        if self.skips.contains(&meta.commit_lsn) {
            return self.queue_skip(pipe, meta, src).await;
        }
        self.queue_changes(pipe, meta, src).await?;
        self.finish_queue(pipe, meta).await
    }

    /// Opens a transaction's local transaction: BEGIN.
    pub(super) async fn queue_begin(
        &mut self,
        pipe: &mut Pipeline,
        meta: &TxnMeta,
    ) -> Result<(), ApplyFailure> {
        self.fk_pending.clear();
        self.txn_open = true;
        pipe.push(
            &self.begin.clone(),
            Vec::new(),
            control_op(OpKind::Control, *meta),
        )
        .await?;
        // In a lane: the lock the next transaction waits for, and the
        // lane's token moved on (`lanes.rs`).
        if let Some(turn) = self.turn {
            pipe.push(
                &self.lane_turn.clone(),
                turn.turn_params().to_vec(),
                control_op(OpKind::Control, *meta),
            )
            .await?;
        }
        Ok(())
    }

    /// Queues the changes `src` holds, after `queue_begin`: all of a
    /// transaction's, or (`early.rs`) the next part of one still arriving.
    pub(super) async fn queue_changes(
        &mut self,
        pipe: &mut Pipeline,
        meta: &TxnMeta,
        src: &mut dyn ChangeSource,
    ) -> Result<(), ApplyFailure> {
        let txn = *meta;
        // Formatted once per call, not per row.
        let guard = self.guard_params(&txn);
        let mut next = src.next_message()?;
        while let Some(msg) = next.take() {
            match msg {
                Message::Relation(r) => {
                    // Catalog lookups need replies before we can go on; they
                    // are rare (first use, or a schema change), so settle first.
                    pipe.settle(0).await?;
                    self.load_relation(r).await?;
                }
                Message::Insert(i) => {
                    // Consecutive inserts into one table go out as multi-row
                    // INSERTs: one protocol round per batch instead of per row.
                    let oid = i.relation_oid;
                    let most = batch_sizes(self.rel(oid)?.local_names.len())[0];
                    let mut batch = vec![i];
                    loop {
                        match src.next_message()? {
                            Some(Message::Insert(j))
                                if j.relation_oid == oid && batch.len() < most =>
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
                Message::Update(u) => {
                    self.note_fk(u.relation_oid, Some(&u.new), u.old.as_ref())?;
                    self.update(pipe, txn, &guard, u, None).await?
                }
                Message::Delete(d) => {
                    self.note_fk(d.relation_oid, None, Some(&d.old))?;
                    self.delete(pipe, txn, &guard, d, None).await?
                }
                // A truncate's version is its commit timestamp: it wins over
                // older rows only. Unknown yet: applied at the commit.
                Message::Truncate(_) if !txn.commit_known() => {
                    return Err(ApplyFailure::to_careful(
                        None,
                        "a truncate before its commit",
                    ));
                }
                Message::Message(m) if !txn.commit_known() && is_partition_truncate(&m) => {
                    return Err(ApplyFailure::to_careful(
                        None,
                        "a truncate before its commit",
                    ));
                }
                Message::Truncate(t) => self.truncate(pipe, txn, t).await?,
                Message::Message(m) if super::compensation::is_compensation(&m) => {
                    return Err(ApplyFailure::to_careful(None, "a compensating delete"));
                }
                Message::Message(m) if is_partition_truncate(&m) => {
                    let stmt = pipe
                        .prepare(
                            &self.stmt_names,
                            "partition truncate",
                            sql::APPLY_PARTITION_TRUNCATE,
                        )
                        .await?;
                    let params = partition_truncate_params(&m, &txn);
                    push_row(
                        0,
                        pipe,
                        &stmt,
                        params,
                        OpKind::Truncate,
                        Arc::from("partition truncate"),
                        txn,
                        Commit::Later,
                    )
                    .await?
                }
                // Types are described for binary mode; we bind text. Other
                // logical messages and origins carry nothing to apply here.
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
        Ok(())
    }

    /// A transaction whose only change is `change`, as one statement that
    /// also records progress: no BEGIN, no separate progress call, no
    /// COMMIT. The invariants hold as for `queue`: the statement fails as a
    /// whole (row missing, version needing the resolver, progress not where
    /// this transaction expects it), and then nothing of it commits.
    pub(super) async fn queue_fused(
        &mut self,
        pipe: &mut Pipeline,
        meta: &TxnMeta,
        change: Message,
    ) -> Result<(), ApplyFailure> {
        let txn = *meta;
        let mut progress = self.progress_params(meta).to_vec();
        // In a lane: the turn, and the wait for the one before after the
        // row change, are in the statement itself (`sql::final_select`).
        if let Some(turn) = self.turn {
            progress.extend(turn.fused_params());
        }
        match change {
            Message::Insert(i) => self.insert(pipe, txn, i, Some(progress)).await,
            Message::Update(u) => {
                let guard = self.guard_params(&txn);
                self.update(pipe, txn, &guard, u, Some(progress)).await
            }
            Message::Delete(d) => {
                let guard = self.guard_params(&txn);
                self.delete(pipe, txn, &guard, d, Some(progress)).await
            }
            other => Err(ApplyFailure::new(
                None,
                format!("not a row change: {}", other.name()),
            )),
        }
    }

    /// Progress guard parameters: this transaction's end on top of
    /// the previous one's.
    pub(super) fn progress_params(&self, meta: &TxnMeta) -> [Param; sql::PROGRESS_PARAMS] {
        [
            Param::text(self.origin.clone()),
            Param::text(self.next_expected.to_string()),
            Param::text(meta.end_lsn.to_string()),
            Param::timestamptz(meta.commit_ts.0),
        ]
    }

    /// In a lane: waits until the transaction before, in another lane, has
    /// committed or rolled back (`lanes.rs`); nothing when there is none.
    async fn push_wait_prev(
        &self,
        pipe: &mut Pipeline,
        turn: Option<super::lanes::Turn>,
        txn: TxnMeta,
    ) -> Result<(), ApplyFailure> {
        match turn.and_then(|t| t.wait_params()) {
            Some(params) => {
                pipe.push(
                    &self.lane_wait,
                    params.to_vec(),
                    control_op(OpKind::Control, txn),
                )
                .await
            }
            None => Ok(()),
        }
    }

    /// Records progress (on top of the previous transaction's) and commits.
    pub(super) async fn finish_queue(
        &mut self,
        pipe: &mut Pipeline,
        meta: &TxnMeta,
    ) -> Result<(), ApplyFailure> {
        let txn = *meta;
        let control = |kind| control_op(kind, txn);
        self.push_fk_checks(pipe, meta).await?;
        // In a lane: the one before has committed or rolled back once this
        // returns, and the guard's own snapshot, taken after it, shows which.
        self.push_wait_prev(pipe, self.turn, txn).await?;
        pipe.push(
            &self.advance.clone(),
            self.progress_params(meta).to_vec(),
            control(OpKind::Control),
        )
        .await?;
        // Sent, the COMMIT ends the transaction either way (an aborted one
        // rolls back).
        self.txn_open = false;
        pipe.push(&self.commit.clone(), Vec::new(), control(OpKind::Commit))
            .await
    }

    pub(super) fn note_fk(
        &mut self,
        oid: u32,
        new: Option<&TupleData>,
        old: Option<&OldTuple>,
    ) -> Result<(), ApplyFailure> {
        let rel = self.rel(oid)?;
        if rel.fks.is_some() {
            let checks = super::fk::checks(rel, new, old);
            self.fk_pending.extend(checks);
        }
        Ok(())
    }

    /// The statement of an orphan check, prepared once per constraint (the
    /// SQL text is built only then: this runs for every row of such tables).
    pub(super) async fn fk_statement(
        &mut self,
        pipe: &mut Pipeline,
        check: &super::fk::FkCheck,
    ) -> Result<(Stmt, Arc<str>), ApplyFailure> {
        let slot = (check.as_child, check.index);
        if let Some(s) = self.rel(check.oid)?.fk_stmts.get(&slot) {
            let child = self.fk_child(check)?;
            return Ok((s.clone(), child));
        }
        let (text, child) = self.fk_sql(check)?;
        let display = Arc::clone(&self.rel(check.oid)?.display);
        let stmt = pipe.prepare(&self.stmt_names, &display, &text).await?;
        self.rel_mut(check.oid)?.fk_stmts.insert(slot, stmt.clone());
        Ok((stmt, child))
    }

    /// The child table an orphan check is about.
    fn fk_child(&self, check: &super::fk::FkCheck) -> Result<Arc<str>, ApplyFailure> {
        let rel = self.rel(check.oid)?;
        let fks = rel
            .fks
            .as_ref()
            .ok_or_else(|| ApplyFailure::new(Some(&*rel.display), "foreign keys vanished"))?;
        let fk = if check.as_child {
            &fks.as_child[check.index]
        } else {
            &fks.as_parent[check.index]
        };
        Ok(Arc::from(fk.child_display.as_str()))
    }

    /// An orphan check's SQL and its child table (the careful path runs it
    /// on its own session).
    pub(super) fn fk_sql(
        &self,
        check: &super::fk::FkCheck,
    ) -> Result<(String, Arc<str>), ApplyFailure> {
        let rel = self.rel(check.oid)?;
        let fks = rel
            .fks
            .as_ref()
            .ok_or_else(|| ApplyFailure::new(Some(&*rel.display), "foreign keys vanished"))?;
        let (fk, text) = if check.as_child {
            let fk = &fks.as_child[check.index];
            (fk, super::fk::child_check_sql(fk, &self.ctx.peer))
        } else {
            let fk = &fks.as_parent[check.index];
            (fk, super::fk::parent_check_sql(fk, &self.ctx.peer))
        };
        Ok((text, Arc::from(fk.child_display.as_str())))
    }

    /// Queues the transaction's orphan checks (after all its changes, so a
    /// parent inserted later in it counts).
    pub(super) async fn push_fk_checks(
        &mut self,
        pipe: &mut Pipeline,
        meta: &TxnMeta,
    ) -> Result<(), ApplyFailure> {
        for check in std::mem::take(&mut self.fk_pending) {
            let (stmt, child) = self.fk_statement(pipe, &check).await?;
            let mut params = vec![
                Param::timestamptz(meta.commit_ts.0),
                Param::text(meta.commit_lsn.to_string()),
            ];
            params.extend(check.params);
            pipe.push(
                &stmt,
                params,
                OpMeta {
                    kind: OpKind::OrphanCheck,
                    relation: Some(child),
                    txn: *meta,
                    rows: 0,
                    commits: false,
                },
            )
            .await?;
        }
        Ok(())
    }

    /// Inserts rows of one relation: full batches as one multi-row INSERT
    /// (a single statement per batch size keeps the cache small), the rest
    /// row by row.
    pub(super) async fn insert_batch(
        &mut self,
        pipe: &mut Pipeline,
        txn: TxnMeta,
        oid: u32,
        rows: Vec<Insert>,
    ) -> Result<(), ApplyFailure> {
        {
            let rel = self.rel(oid)?;
            if rel.fks.is_some() {
                let checks: Vec<_> = rows
                    .iter()
                    .flat_map(|i| super::fk::checks(rel, Some(&i.new), None))
                    .collect();
                self.fk_pending.extend(checks);
            }
        }
        let width = self.rel(oid)?.local_names.len();
        let mut done = 0;
        for (slot, n) in batch_sizes(width).into_iter().enumerate() {
            while n >= 2 && rows.len() - done >= n {
                let chunk = &rows[done..done + n];
                done += n;
                let rel = self.rel(oid)?;
                let display = Arc::clone(&rel.display);
                let mut params = Vec::with_capacity(width * n + sql::INSERT_EXTRA_PARAMS);
                for ins in chunk {
                    params.extend(tuple_params(&ins.new, rel, None)?);
                }
                params.extend(self.insert_extra(&txn));
                let stmt = match &rel.insert_batch[slot] {
                    Some(s) => s.clone(),
                    None => {
                        let text = fast_insert_sql(rel, n, Commit::Later);
                        let s = pipe.prepare(&self.stmt_names, &display, &text).await?;
                        self.rel_mut(oid)?.insert_batch[slot] = Some(s.clone());
                        s
                    }
                };
                push_row(
                    n as u64,
                    pipe,
                    &stmt,
                    params,
                    OpKind::Insert,
                    display,
                    txn,
                    Commit::Later,
                )
                .await?;
            }
        }
        for ins in rows.into_iter().skip(done) {
            self.insert(pipe, txn, ins, None).await?;
        }
        Ok(())
    }

    /// The parameters after an INSERT's rows (`sql::INSERT_EXTRA_PARAMS`).
    fn insert_extra(&self, txn: &TxnMeta) -> [Param; sql::INSERT_EXTRA_PARAMS] {
        [Param::timestamptz(txn.commit_ts.0), self.peer_param.clone()]
    }

    /// One row; `progress` makes it the whole transaction (`Commit::Fused`).
    pub(super) async fn insert(
        &mut self,
        pipe: &mut Pipeline,
        txn: TxnMeta,
        ins: Insert,
        progress: Option<Vec<Param>>,
    ) -> Result<(), ApplyFailure> {
        let rel = self.rel(ins.relation_oid)?;
        let mut params = tuple_params(&ins.new, rel, None)?;
        params.extend(self.insert_extra(&txn));
        let display = Arc::clone(&rel.display);
        let commit = commit_at(&mut params, progress);
        let slot = match commit {
            Commit::Later => 0,
            Commit::Fused { lane: false, .. } => 1,
            Commit::Fused { lane: true, .. } => 2,
        };
        let stmt = match &rel.insert[slot] {
            Some(s) => s.clone(),
            None => {
                let text = fast_insert_sql(rel, 1, commit);
                let s = pipe.prepare(&self.stmt_names, &display, &text).await?;
                self.rel_mut(ins.relation_oid)?.insert[slot] = Some(s.clone());
                s
            }
        };
        push_row(1, pipe, &stmt, params, OpKind::Insert, display, txn, commit).await
    }

    pub(super) async fn update(
        &mut self,
        pipe: &mut Pipeline,
        txn: TxnMeta,
        guard: &Guard,
        mut upd: Update,
        progress: Option<Vec<Param>>,
    ) -> Result<(), ApplyFailure> {
        // Unchanged TOAST means "as in the publisher's row". That row may
        // hold a change from a third node this node has not applied yet
        // (its stream lags): then the local value is not the publisher's,
        // and the later change would lose to this one here but not there.
        // Take the values from the publisher instead (`fetch_unchanged`).
        // Whether to depends on the commit timestamp: when it is not known
        // yet, the change is applied at the commit.
        let unchanged = |u: &Update| {
            u.new
                .columns
                .iter()
                .any(|c| matches!(c, ColumnValue::UnchangedToast))
        };
        if !txn.commit_known() && unchanged(&upd) {
            return Err(ApplyFailure::to_careful(
                None,
                "unchanged TOAST before the commit",
            ));
        }
        if let Some(ts) = txn.commit_ts.to_datetime()
            && unchanged(&upd)
            && self.base_may_be_stale(ts)
            && let super::careful::OriginRow::Fetched(full) =
                self.fetch_unchanged(upd.relation_oid, &upd.new, ts).await?
        {
            upd.new = full;
        }
        let rel = self.rel(upd.relation_oid)?;
        let display = Arc::clone(&rel.display);
        let set_mask = rel.set_mask(&upd.new);
        if set_mask.len() != rel.local_names.len() {
            return Err(column_count(rel, set_mask.len()));
        }
        let mut params = tuple_params(&upd.new, rel, Some(&set_mask))?;
        let (match_mask, match_params) = locate(rel, upd.old.as_ref(), Some(&upd.new))?;
        // A key change is a delete of the old key and an insert at the new
        // one, each judged on its own key (careful/write.rs, `careful_move`).
        if super::careful::key_changed(rel, &upd, &match_params) {
            return Err(ApplyFailure::to_careful(Some(&display), "a key change"));
        }
        // A key that just conflicted (`hot.rs`): the statement settles the
        // conflict itself when it can.
        // Cheapest test first: every UPDATE passes here.
        let in_place = !match_mask.contains(&true)
            && self
                .hot
                .contains(super::hot::fingerprint(upd.relation_oid, &match_params))
            && self.resolves_in_place(&txn, &upd);
        let rel = self.rel(upd.relation_oid)?;
        let loc_params = match_params.len();
        params.extend(match_params);
        // Columns left out of SET keep the local row's values: routine only
        // if the publisher surely had that version (`Guard::params`).
        params.extend(guard.params(unchanged(&upd)));
        if in_place {
            params.extend(self.in_place_params(&txn, &display));
        }
        let commit = commit_at(&mut params, progress);
        let key = (set_mask, match_mask, commit, in_place);
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
                let text = match rel.key_names() {
                    Some(keys) if in_place => {
                        let types: Vec<&str> = rel.local_types.iter().map(String::as_str).collect();
                        sql::fast_update_in_place(&rel.table_sql, &set_cols, &types, &keys, commit)
                    }
                    _ => sql::fast_update(
                        &rel.table_sql,
                        &set_cols,
                        &masked_locator(rel, &key.1),
                        loc_params,
                        commit,
                    ),
                };
                let s = pipe.prepare(&self.stmt_names, &display, &text).await?;
                self.rel_mut(upd.relation_oid)?
                    .update
                    .insert(key, s.clone());
                s
            }
        };
        let kind = if in_place {
            OpKind::UpdateInPlace
        } else {
            OpKind::Update
        };
        push_row(1, pipe, &stmt, params, kind, display, txn, commit).await
    }

    /// `sql::IN_PLACE_PARAMS`: what a resolving UPDATE logs and compares
    /// with, the origin names as the careful path knows them (`origins`).
    fn in_place_params(&self, txn: &TxnMeta, display: &str) -> [Param; sql::IN_PLACE_PARAMS] {
        [
            Param::text(display),
            Param::text(txn.commit_lsn.to_string()),
            Param::text(self.ctx.peer.clone()),
            Param::text(self.ctx.local_node.clone()),
            self.origin_params.0.clone(),
            self.origin_params.1.clone(),
        ]
    }

    pub(super) async fn delete(
        &mut self,
        pipe: &mut Pipeline,
        txn: TxnMeta,
        guard: &Guard,
        del: Delete,
        progress: Option<Vec<Param>>,
    ) -> Result<(), ApplyFailure> {
        let rel = self.rel(del.relation_oid)?;
        let display = Arc::clone(&rel.display);
        let (match_mask, mut params) = locate(rel, Some(&del.old), None)?;
        let loc_params = params.len();
        params.extend(guard.params(false));
        let commit = commit_at(&mut params, progress);
        let key = (match_mask, commit, self.tombstone_write(rel));
        let stmt = match rel.delete.get(&key) {
            Some(s) => s.clone(),
            None => {
                let text = sql::fast_delete(
                    &rel.table_sql,
                    &masked_locator(rel, &key.0),
                    loc_params,
                    rel.relid,
                    rel.key_names().as_deref(),
                    commit,
                    key.2,
                );
                let s = pipe.prepare(&self.stmt_names, &display, &text).await?;
                self.rel_mut(del.relation_oid)?
                    .delete
                    .insert(key, s.clone());
                s
            }
        };
        push_row(1, pipe, &stmt, params, OpKind::Delete, display, txn, commit).await
    }

    pub(super) async fn truncate(
        &mut self,
        pipe: &mut Pipeline,
        txn: TxnMeta,
        t: Truncate,
    ) -> Result<(), ApplyFailure> {
        let (display, params) = self.truncate_params(&txn, &t)?;
        let stmt = pipe
            .prepare(&self.stmt_names, &display, sql::APPLY_TRUNCATE)
            .await?;
        push_row(
            0,
            pipe,
            &stmt,
            params,
            OpKind::Truncate,
            display,
            txn,
            Commit::Later,
        )
        .await
    }

    /// The tables of a TRUNCATE (shown as one relation) and the parameters
    /// of `sql::APPLY_TRUNCATE`: the truncate wins over every older row on
    /// every node and loses to newer ones.
    pub(super) fn truncate_params(
        &self,
        txn: &TxnMeta,
        t: &Truncate,
    ) -> Result<(Arc<str>, Vec<Param>), ApplyFailure> {
        let mut names = Vec::with_capacity(t.relation_oids.len());
        let mut oids = Vec::with_capacity(t.relation_oids.len());
        for oid in &t.relation_oids {
            let rel = self.rel(*oid)?;
            names.push(rel.display.to_string());
            oids.push(rel.relid);
        }
        Ok((
            Arc::from(names.join(", ").as_str()),
            vec![
                Param::oid_array(&oids),
                Param::timestamptz(txn.commit_ts.0),
                Param::text(t.cascade.to_string()),
                Param::text(t.restart_identity.to_string()),
            ],
        ))
    }
}

pub(super) fn fast_insert_sql(rel: &LocalRelation, rows: usize, commit: Commit) -> String {
    let cols: Vec<&str> = rel.local_names.iter().map(String::as_str).collect();
    let types: Vec<&str> = rel.local_types.iter().map(String::as_str).collect();
    sql::fast_insert(
        &rel.table_sql,
        &cols,
        &types,
        rows,
        rel.relid,
        rel.key_names().as_deref(),
        commit,
    )
}

/// A statement of the transaction itself (BEGIN, progress, COMMIT, audit).
pub(super) fn control_op(kind: OpKind, txn: TxnMeta) -> OpMeta {
    OpMeta {
        kind,
        relation: None,
        txn,
        rows: 0,
        commits: kind == OpKind::Commit,
    }
}

/// Appends the progress parameters of a one-statement transaction (and, in
/// a lane, its turn's: `lanes::Turn::fused_params`) after a row statement's own,
/// and says where they start.
pub(super) fn commit_at(params: &mut Vec<Param>, progress: Option<Vec<Param>>) -> Commit {
    match progress {
        None => Commit::Later,
        Some(p) => {
            let first = params.len() + 1;
            let lane = p.len() > sql::PROGRESS_PARAMS;
            params.extend(p);
            Commit::Fused { first, lane }
        }
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) async fn push_row(
    rows: u64,
    pipe: &mut Pipeline,
    stmt: &Stmt,
    params: Vec<Param>,
    kind: OpKind,
    relation: Arc<str>,
    txn: TxnMeta,
    commit: Commit,
) -> Result<(), ApplyFailure> {
    let meta = OpMeta {
        kind,
        relation: Some(relation),
        txn,
        rows,
        commits: commit != Commit::Later,
    };
    pipe.push(stmt, params, meta).await
}

/// `INSERT_BATCHES` for a table of `width` columns, within the parameter
/// limit (a size below 2 is not used).
pub(super) fn batch_sizes(width: usize) -> [usize; 3] {
    let most = (MAX_PARAMS - sql::INSERT_EXTRA_PARAMS) / width.max(1);
    INSERT_BATCHES.map(|n| n.min(most))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_batches_stay_within_the_parameter_limit() {
        assert_eq!(batch_sizes(3), [1000, 100, 10]);
        // 65534 params for the rows: 200 columns fit 327 rows.
        assert_eq!(batch_sizes(200), [327, 100, 10]);
        assert_eq!(batch_sizes(1000), [65, 65, 10]);
        // Too wide for two rows: row by row (sizes below 2 are not used).
        assert_eq!(batch_sizes(40000), [1, 1, 1]);
        for w in [1, 7, 66, 655, 656, 1600] {
            for n in batch_sizes(w) {
                assert!(
                    n * w + sql::INSERT_EXTRA_PARAMS <= MAX_PARAMS,
                    "width {w}: {n} rows"
                );
            }
        }
    }
}
