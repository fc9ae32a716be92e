//! The careful path per change: an INSERT (or an UPDATE that found no row
//! and is put in), an UPDATE in place or moving its key, a DELETE; each
//! locks and reads what it touches, judges it and writes the outcome.

use mm_proto::pgoutput::{ColumnValue, Delete, Insert, TupleData, Update};
use serde_json::Value;

use crate::apply::relation::LocalRelation;
use crate::apply::sql::{self, Locator};
use crate::apply::tuple::{locate, masked_locator, tuple_params, unchanged_mask};
use crate::apply::txn::TxnMeta;
use crate::apply::{Applier, ApplyFailure, Param};
use crate::conflict::classify::{self, Facts, Op, Plan, Write};
use crate::conflict::{Conflict, ConflictType};

use super::{Found, Judgement, OriginRow, Outcome, Version, key_changed, key_of, remote_ts};

impl Applier {
    pub(super) async fn careful_insert(
        &mut self,
        meta: &TxnMeta,
        ins: Insert,
        out: &mut Outcome,
    ) -> Result<(), ApplyFailure> {
        self.careful_put(
            meta,
            ins.relation_oid,
            Op::Insert,
            &ins.new,
            None,
            false,
            out,
        )
        .await
    }

    /// A new row at its key: an insert, the new key of a key change
    /// (`Op::MovedIn`), or an update of a missing row that won
    /// (`tombstone_beaten`). `new` is complete (no unchanged TOAST).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn careful_put(
        &mut self,
        meta: &TxnMeta,
        oid: u32,
        op: Op,
        new: &TupleData,
        remote_old: Option<Value>,
        tombstone_beaten: bool,
        out: &mut Outcome,
    ) -> Result<(), ApplyFailure> {
        let rts = remote_ts(meta);
        let rel = self.rel(oid)?;
        let params = tuple_params(new, rel, None)?;
        let key_params: Vec<Param> = rel.key_remote.iter().map(|&i| params[i].clone()).collect();
        let target = match &rel.locator {
            Locator::Key(_) => self.fetch_target(rel, &rel.locator, &key_params).await?,
            Locator::AllColumns(_) => None,
        };
        let collisions = self
            .fetch_collisions(
                rel,
                &new.columns,
                target.as_ref().and_then(|t| t.ctid.as_deref()),
            )
            .await?;
        let key = (!tombstone_beaten).then_some(key_params.as_slice());
        let found = self.found(rel, target, collisions, key).await?;
        let facts = self.facts(op, &found, rts);
        let remote_new = Some(self.tuple_json(rel, &new.columns, |_| true).await?);
        let key = remote_new.as_ref().and_then(|v| key_of(rel, v));
        let cols: Vec<&str> = rel.local_names.iter().map(String::as_str).collect();
        let plain_insert = sql::insert(&rel.table_sql, &cols);
        let write = (plain_insert.as_str(), params.as_slice());
        let Some((c, plan)) = self
            .judge_write(
                oid,
                meta,
                facts,
                &found,
                (&remote_old, &remote_new),
                write,
                found.tombstone.as_ref(),
                out,
            )
            .await?
        else {
            return Ok(());
        };
        let rel = self.rel(oid)?;
        self.carry_out(
            rel,
            meta,
            &plan,
            &found,
            &key_params,
            remote_new.as_ref(),
            &c,
        )
        .await?;
        if plan.write == Write::Change {
            // Over an existing row: carry_out deleted it (delete_target).
            self.exec_row(rel, &plain_insert, &params).await?;
        }
        self.log_conflict(rel, meta, &c, key, plan.label, out).await
    }

    /// Judges a change (`judge`) and settles the outcomes the resolver has
    /// no part in: routine, applied by `write` (`passed`, the local version
    /// it replaces or passes, counted as routine); older than its table's
    /// truncate, logged and dropped. Otherwise the resolver's decision.
    #[allow(clippy::too_many_arguments)]
    async fn judge_write(
        &mut self,
        oid: u32,
        meta: &TxnMeta,
        facts: Facts,
        found: &Found,
        (remote_old, remote_new): (&Option<Value>, &Option<Value>),
        write: (&str, &[Param]),
        passed: Option<&Version>,
        out: &mut Outcome,
    ) -> Result<Option<(Conflict, Plan)>, ApplyFailure> {
        let rel = self.rel(oid)?;
        match self
            .judge(rel, meta, facts, found, remote_old, remote_new)
            .await?
        {
            Judgement::Apply => {
                self.exec_row(rel, write.0, write.1).await?;
                if let Some(v) = passed {
                    self.note_routine(v);
                }
                Ok(None)
            }
            Judgement::Truncated(kind) => {
                let (old, new) = (remote_old.clone(), remote_new.clone());
                self.log_truncated(oid, meta, kind, found, old, new, out)
                    .await?;
                Ok(None)
            }
            Judgement::Decided(d) => Ok(Some(*d)),
        }
    }

    /// Logs a change discarded for being older than its table's truncate.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn log_truncated(
        &mut self,
        oid: u32,
        meta: &TxnMeta,
        kind: ConflictType,
        found: &Found,
        remote_old: Option<Value>,
        remote_new: Option<Value>,
        out: &mut Outcome,
    ) -> Result<(), ApplyFailure> {
        let rel = self.rel(oid)?;
        let key = remote_old
            .as_ref()
            .or(remote_new.as_ref())
            .and_then(|v| key_of(rel, v));
        let c = self.conflict(
            kind,
            rel,
            meta,
            found.truncate.as_ref(),
            remote_old,
            remote_new,
        );
        self.log_conflict(rel, meta, &c, key, "keep_local", out)
            .await
    }

    /// Writes a row a resolver chose: over the local row `over`, or as a
    /// new one.
    pub(super) async fn write_row(
        &self,
        rel: &LocalRelation,
        row: &Value,
        over: Option<&Version>,
    ) -> Result<(), ApplyFailure> {
        let cols: Vec<&str> = rel.local_names.iter().map(String::as_str).collect();
        match over.and_then(|v| v.ctid.clone()) {
            Some(ctid) => {
                self.exec(
                    rel,
                    &sql::update_json(&rel.table_sql, &rel.settable_names()),
                    &[Param::text(row.to_string()), Param::text(ctid)],
                )
                .await?
            }
            None => {
                self.exec(
                    rel,
                    &sql::insert_json(&rel.table_sql, &cols),
                    &[Param::text(row.to_string())],
                )
                .await?
            }
        };
        Ok(())
    }

    pub(super) async fn delete_versions(
        &self,
        rel: &LocalRelation,
        vs: &[&Version],
    ) -> Result<(), ApplyFailure> {
        let text = sql::delete_ctid(&rel.table_sql);
        for v in vs {
            if let Some(ctid) = &v.ctid {
                self.exec(rel, &text, &[Param::text(ctid.clone())]).await?;
            }
        }
        Ok(())
    }

    pub(super) async fn careful_update(
        &mut self,
        meta: &TxnMeta,
        mut upd: Update,
        out: &mut Outcome,
    ) -> Result<(), ApplyFailure> {
        let oid = upd.relation_oid;
        let rts = remote_ts(meta);
        let rel = self.rel(oid)?;
        let (match_mask, loc_params) = locate(rel, upd.old.as_ref(), Some(&upd.new))?;
        if key_changed(rel, &upd, &loc_params) {
            return self.careful_move(meta, upd, loc_params, out).await;
        }
        let loc = masked_locator(rel, &match_mask);
        let toast = upd
            .new
            .columns
            .iter()
            .any(|c| matches!(c, ColumnValue::UnchangedToast));
        // Two reads that do not depend on each other, in one round trip: the
        // target and the incoming row as the conflict log and resolvers see
        // it (unless it is to be completed from its origin first).
        let (target, new_json) = if toast {
            (self.fetch_target(rel, &loc, &loc_params).await?, None)
        } else {
            let (t, n) = futures_util::try_join!(
                self.fetch_target(rel, &loc, &loc_params),
                self.tuple_json(rel, &upd.new.columns, |_| true)
            )?;
            (t, Some(n))
        };
        // A conflicting update with unchanged-TOAST columns: complete it
        // from its origin first, so resolvers see the whole row and the
        // winner is written whole on every node.
        let mut gone_on_origin = false;
        if toast {
            let conflicting = target
                .as_ref()
                .is_none_or(|t| !self.no_conflict(t, rts, true))
                || self.base_may_be_stale(rts);
            if conflicting {
                match self.fetch_unchanged(oid, &upd.new, rts).await? {
                    OriginRow::Fetched(full) => upd.new = full,
                    OriginRow::Gone => gone_on_origin = true,
                    OriginRow::Unavailable(why) => {
                        tracing::debug!(why, "unchanged TOAST values not available from the origin")
                    }
                }
            }
        }
        let rel = self.rel(oid)?;
        let set_mask = rel.set_mask(&upd.new);
        let mut update_params = tuple_params(&upd.new, rel, Some(&set_mask))?;
        update_params.extend(loc_params.iter().cloned());
        let set_cols: Vec<&str> = rel
            .local_names
            .iter()
            .zip(&set_mask)
            .filter(|(_, skip)| !**skip)
            .map(|(n, _)| n.as_str())
            .collect();
        let plain_update = sql::update(&rel.table_sql, &set_cols, &loc);
        let remote_old = match &upd.old {
            Some(old) => Some(self.old_json(rel, old).await?),
            None => None,
        };
        let remote_new = match new_json {
            Some(v) => v,
            None => self.tuple_json(rel, &upd.new.columns, |_| true).await?,
        };
        let key = key_of(rel, remote_old.as_ref().unwrap_or(&remote_new));
        let collisions = match &target {
            Some(t) => {
                self.fetch_collisions(rel, &upd.new.columns, t.ctid.as_deref())
                    .await?
            }
            None => Vec::new(),
        };
        let found = self
            .found(rel, target, collisions, Some(&loc_params))
            .await?;
        let facts = self.facts(Op::Update, &found, rts);
        let remote_new = Some(remote_new);
        let write = (plain_update.as_str(), update_params.as_slice());
        let Some((c, plan)) = self
            .judge_write(
                oid,
                meta,
                facts,
                &found,
                (&remote_old, &remote_new),
                write,
                found.target.as_ref(),
                out,
            )
            .await?
        else {
            return Ok(());
        };
        let rel = self.rel(oid)?;
        let kind = c.kind;
        if plan.write == Write::AsInsert {
            // The row is gone here and the update wins: it becomes an
            // insert of its new row, which needs every column.
            if unchanged_mask(&upd.new).iter().any(|u| *u) {
                if gone_on_origin {
                    // Deleted on its origin since: that delete arrives
                    // after this change and removes the row everywhere;
                    // inserting it now would need values nobody has.
                    tracing::info!(relation = %rel.display, kind = kind.as_str(),
                        "update of a missing row with unchanged TOAST columns: the row is gone on its origin too; not inserting it");
                    return self
                        .log_conflict(rel, meta, &c, key, "keep_local", out)
                        .await;
                }
                return Err(Self::toast_unavailable(
                    rel,
                    kind.as_str(),
                    key.as_ref(),
                    &upd.new,
                ));
            }
            self.log_conflict(rel, meta, &c, key, plan.label, out)
                .await?;
            return self
                .careful_put(meta, oid, Op::MovedIn, &upd.new, remote_old, true, out)
                .await;
        }
        self.carry_out(
            rel,
            meta,
            &plan,
            &found,
            &loc_params,
            remote_new.as_ref(),
            &c,
        )
        .await?;
        if plan.write == Write::Change {
            self.exec_row(rel, &plain_update, &update_params).await?;
        }
        self.log_conflict(rel, meta, &c, key, plan.label, out).await
    }

    /// An update that changed the key: a delete of the old key and an
    /// insert at the new one, each judged on its own key, so every node
    /// ends with the same versions at both whatever else happened to them
    /// (a node that applied a newer change to the old row keeps it, and
    /// still gets the new one).
    pub(super) async fn careful_move(
        &mut self,
        meta: &TxnMeta,
        upd: Update,
        old_key: Vec<Param>,
        out: &mut Outcome,
    ) -> Result<(), ApplyFailure> {
        let oid = upd.relation_oid;
        let rts = remote_ts(meta);
        let rel = self.rel(oid)?;
        let target = self.fetch_target(rel, &rel.locator, &old_key).await?;
        let remote_old = match &upd.old {
            Some(old) => self.old_json(rel, old).await?,
            None => Value::Null,
        };
        // The new row whole: from the moved row if it is the version the
        // publisher changed, else from the publisher.
        let mut new = Some(upd.new.clone());
        if unchanged_mask(&upd.new).iter().any(|u| *u) {
            let local = target
                .as_ref()
                .filter(|t| self.no_conflict(t, rts, true) && !self.base_may_be_stale(rts))
                .and_then(|t| t.ctid.clone());
            tracing::debug!(relation = %rel.display, old_key = ?old_key,
                target = ?target.as_ref().map(|t| self.seen(t, rts)),
                stale = self.base_may_be_stale(rts), from_local = local.is_some(),
                "a moved row's unchanged TOAST values");
            new = match local {
                Some(at) => Some(self.complete_from_local(rel, &upd.new, &at).await?),
                None => match self.fetch_unchanged(oid, &upd.new, rts).await? {
                    OriginRow::Fetched(full) => Some(full),
                    // Changed again on its origin since: that change follows.
                    OriginRow::Gone => None,
                    OriginRow::Unavailable(why) => {
                        let rel = self.rel(oid)?;
                        let remote_new = self.tuple_json(rel, &upd.new.columns, |_| true).await?;
                        tracing::debug!(why, "unchanged TOAST values of a moved row not available");
                        return Err(Self::toast_unavailable(
                            rel,
                            "update_exists",
                            key_of(rel, &remote_new).as_ref(),
                            &upd.new,
                        ));
                    }
                },
            };
        }
        let rel = self.rel(oid)?;
        let remote_new = self.tuple_json(rel, &upd.new.columns, |_| true).await?;
        let wrote_row = self
            .careful_remove(
                meta,
                oid,
                Op::MovedOut,
                target,
                old_key,
                remote_old.clone(),
                Some(remote_new),
                false,
                out,
            )
            .await?;
        match new {
            Some(new) if !wrote_row => {
                self.careful_put(meta, oid, Op::MovedIn, &new, Some(remote_old), false, out)
                    .await
            }
            _ => Ok(()),
        }
    }

    pub(super) async fn careful_delete(
        &mut self,
        meta: &TxnMeta,
        del: Delete,
        out: &mut Outcome,
    ) -> Result<(), ApplyFailure> {
        let rel = self.rel(del.relation_oid)?;
        let (match_mask, loc_params) = locate(rel, Some(&del.old), None)?;
        let loc = masked_locator(rel, &match_mask);
        let target = self.fetch_target(rel, &loc, &loc_params).await?;
        let remote_old = self.old_json(rel, &del.old).await?;
        self.careful_remove(
            meta,
            del.relation_oid,
            Op::Delete,
            target,
            loc_params,
            remote_old,
            None,
            false,
            out,
        )
        .await
        .map(|_| ())
    }

    /// A key going away: a delete, the old key of a key change
    /// (`Op::MovedOut`), or a compensating delete from a peer. `target` is
    /// the locked row found at it. True when a resolver's row was written
    /// in its place (a key change then writes nothing at its new key).
    #[allow(clippy::too_many_arguments)]
    pub(in crate::apply) async fn careful_remove(
        &mut self,
        meta: &TxnMeta,
        oid: u32,
        op: Op,
        target: Option<Version>,
        loc_params: Vec<Param>,
        remote_old: Value,
        remote_new: Option<Value>,
        compensating: bool,
        out: &mut Outcome,
    ) -> Result<bool, ApplyFailure> {
        let rts = remote_ts(meta);
        let rel = self.rel(oid)?;
        let keyed = matches!(rel.locator, Locator::Key(_));
        let found = self
            .found(rel, target, Vec::new(), Some(&loc_params))
            .await?;
        let facts = self.facts(op, &found, rts);
        let key = key_of(rel, &remote_old);
        let remote_old = Some(remote_old);
        let (c, plan) = match self
            .judge(rel, meta, facts.clone(), &found, &remote_old, &remote_new)
            .await?
        {
            Judgement::Apply => {
                let plan = classify::plan_routine(&facts);
                if let Some(t) = &found.target {
                    self.delete_versions(rel, &[t]).await?;
                    out.rows += 1;
                }
                if plan.tombstone && keyed {
                    self.write_tombstone(rel, &loc_params).await?;
                }
                if let Some(t) = found.target.clone() {
                    self.note_routine(&t);
                }
                return Ok(false);
            }
            Judgement::Truncated(kind) => {
                self.log_truncated(oid, meta, kind, &found, remote_old, remote_new, out)
                    .await?;
                return Ok(false);
            }
            Judgement::Decided(d) => *d,
        };
        let kind = c.kind;
        let rel = self.rel(oid)?;
        self.carry_out(
            rel,
            meta,
            &plan,
            &found,
            &loc_params,
            remote_old.as_ref(),
            &c,
        )
        .await?;
        if plan.delete_target {
            out.rows += 1;
        }
        // A compensating delete usually finds its key already gone (the
        // collision removed it here too): expected, not a conflict.
        if !(compensating && kind == ConflictType::DeleteMissing) {
            self.log_conflict(rel, meta, &c, key, plan.label, out)
                .await?;
        }
        Ok(matches!(plan.write, Write::Row(_)))
    }
}
