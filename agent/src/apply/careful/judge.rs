//! Judging a change on the careful path: the local version it meets is
//! routine (the publisher's own, this transaction's, older than what the
//! publisher had seen) or a conflict, classified with PostgreSQL 18's
//! names (`conflict::classify`); the table's resolver decides, the
//! decision is carried out and logged in `mm.conflict_log` in the same
//! local transaction.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use serde_json::Value;

use crate::apply::relation::LocalRelation;
use crate::apply::sql::Locator;
use crate::apply::txn::TxnMeta;
use crate::apply::{Applier, ApplyFailure, Param};
use crate::conflict::classify::{self, Detection, Facts, Op, Plan, Seen, Write};
use crate::conflict::{Conflict, ConflictType, Resolution, ResolverChoice};

use super::{Found, Judgement, Outcome, Version, fail, key_of, params_ref, remote_ts, stop};

impl Applier {
    pub(super) fn origin_name(&self, v: &Version) -> Option<String> {
        v.roident
            .map(|id| {
                self.origins
                    .get(&id)
                    .cloned()
                    .unwrap_or_else(|| format!("origin {id}"))
            })
            .or_else(|| Some(self.ctx.local_node.clone()))
    }

    /// The routine test (`conflict::routine`, the same rule `mm.routine`
    /// applies on the fast path). `margin`: take the peer's watermark less
    /// `watermark::ORDER_MARGIN`, when values are kept from the local row
    /// (`applier::Guard::params` says why).
    pub(super) fn no_conflict(&self, v: &Version, remote_ts: DateTime<Utc>, margin: bool) -> bool {
        let facts = crate::conflict::routine::VersionFacts {
            roident: v.roident,
            ts: v.ts,
            this_txn: v.this_txn,
        };
        crate::conflict::routine::no_resolver_needed(
            &facts,
            &self.peer_roidents,
            |id| {
                let node = self.origins.get(&id)?;
                let w = self.wm.map.get(node).copied()?;
                Some(if margin {
                    w - crate::watermark::ORDER_MARGIN
                } else {
                    w
                })
            },
            remote_ts,
        )
    }

    /// Counts a no-conflict change to another origin's version as routine.
    pub(super) fn note_routine(&mut self, v: &Version) {
        if !v.this_txn && !v.roident.is_some_and(|r| self.peer_roidents.contains(&r)) {
            self.count_routine();
        }
    }

    /// Asks the table's resolver.
    pub(super) async fn resolve(
        &self,
        rel: &LocalRelation,
        c: &Conflict,
    ) -> Result<Resolution, ApplyFailure> {
        match self.ctx.resolvers.for_table(&rel.display) {
            ResolverChoice::Rust(r) => Ok(r.resolve(c)),
            ResolverChoice::Sql { function } => {
                let pg = |e: tokio_postgres::Error| ApplyFailure::from_pg(Some(&*rel.display), &e);
                let stmt = self
                    .prepared(&format!("SELECT {function}($1::jsonb)"))
                    .await
                    .map_err(pg)?;
                let row = self
                    .client
                    .query_one(&stmt, &params_ref(&[Param::text(c.to_json().to_string())]))
                    .await
                    .map_err(pg)?;
                let v: Option<Value> = row.try_get(0).map_err(|e| fail(rel, e.to_string()))?;
                Ok(match v {
                    None | Some(Value::Null) => Resolution::NoRow,
                    Some(v) => Resolution::Row(v),
                })
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) async fn log_conflict(
        &self,
        rel: &LocalRelation,
        meta: &TxnMeta,
        c: &Conflict,
        key: Option<Value>,
        resolution: &str,
        out: &mut Outcome,
    ) -> Result<(), ApplyFailure> {
        let remote_tuple = c.remote_new.clone().or_else(|| c.remote_old.clone());
        let opt_json = |v: Option<Value>| match v {
            Some(v) => Param::text(v.to_string()),
            None => Param::Null,
        };
        out.log_rows.push((
            Arc::clone(&rel.display),
            vec![
                Param::text(rel.display.to_string()),
                Param::text(c.kind.as_str().to_owned()),
                opt_json(key),
                c.local_origin.clone().map_or(Param::Null, Param::text),
                c.local_commit_ts
                    .map_or(Param::Null, |t| Param::text(t.to_rfc3339())),
                Param::text(c.remote_origin.clone()),
                Param::text(meta.commit_ts.to_string()),
                Param::text(meta.commit_lsn.to_string()),
                Param::text(resolution.to_owned()),
                opt_json(c.local.clone()),
                opt_json(remote_tuple),
            ],
        ));
        out.conflicts
            .push((c.kind.as_str(), Arc::clone(&rel.display)));
        Ok(())
    }

    pub(super) fn conflict(
        &self,
        kind: ConflictType,
        rel: &LocalRelation,
        meta: &TxnMeta,
        local: Option<&Version>,
        remote_old: Option<Value>,
        remote_new: Option<Value>,
    ) -> Conflict {
        Conflict {
            kind,
            relation: rel.display.to_string(),
            local: local.and_then(|v| v.row.clone()),
            remote_old,
            remote_new,
            local_origin: local.and_then(|v| self.origin_name(v)),
            local_commit_ts: local.and_then(|v| v.ts),
            remote_origin: self.ctx.peer.clone(),
            remote_commit_ts: remote_ts(meta),
        }
    }

    /// Carries out a row a resolver chose: equal to the incoming or the local
    /// row means exactly that; anything else is written as given.
    pub(super) fn classify_row(r: Resolution, c: &Conflict) -> Resolution {
        match r {
            Resolution::Row(v) if c.remote_new.as_ref() == Some(&v) => Resolution::ApplyRemote,
            Resolution::Row(v) if c.local.as_ref() == Some(&v) => Resolution::KeepLocal,
            other => other,
        }
    }

    /// A local version as the rules see it.
    pub(super) fn seen(&self, v: &Version, rts: DateTime<Utc>) -> Seen {
        Seen {
            routine: self.no_conflict(v, rts, false),
            ts: v.ts,
            origin: self.origin_name(v),
        }
    }

    /// The rules' facts from what was found.
    pub(super) fn facts(&self, op: Op, found: &Found, rts: DateTime<Utc>) -> Facts {
        Facts {
            op,
            target: found.target.as_ref().map(|v| self.seen(v, rts)),
            tombstone: found.tombstone.as_ref().map(|v| self.seen(v, rts)),
            collisions: found.collisions.iter().map(|v| self.seen(v, rts)).collect(),
            truncated: found
                .truncate
                .as_ref()
                .is_some_and(|t| !t.this_txn && t.ts.is_some_and(|ts| rts <= ts)),
            target_beaten: false,
        }
    }

    /// What a change meets here: its target, the rows holding its unique
    /// values, and, where no row is at its key, the key's tombstone (read
    /// with `key`, the locator's values; none for a table without a key, or
    /// without `key`: one the change already beat) and the table's
    /// truncate (a row at the key is newer than any truncate that left it).
    pub(super) async fn found(
        &self,
        rel: &LocalRelation,
        target: Option<Version>,
        collisions: Vec<Version>,
        key: Option<&[Param]>,
    ) -> Result<Found, ApplyFailure> {
        let (tombstone, truncate) = match (&target, key) {
            (Some(_), _) => (None, None),
            (None, Some(key)) => (
                self.fetch_tombstone(rel, key).await?,
                self.fetch_truncate(rel).await?,
            ),
            (None, None) => (None, self.fetch_truncate(rel).await?),
        };
        Ok(Found {
            target,
            tombstone,
            collisions,
            truncate,
        })
    }

    /// Detects, asks the resolver and plans, in one or two decisions (the
    /// change's own key first, then the rows holding its unique values:
    /// `Plan::next`). One conflict comes out for both: the first decision's
    /// type, the second's versions and outcome.
    pub(super) async fn judge(
        &self,
        rel: &LocalRelation,
        meta: &TxnMeta,
        mut facts: Facts,
        found: &Found,
        remote_old: &Option<Value>,
        remote_new: &Option<Value>,
    ) -> Result<Judgement, ApplyFailure> {
        let mut first_kind = None;
        loop {
            let (kind, local) = match classify::detect(&facts) {
                Detection::Apply => return Ok(Judgement::Apply),
                Detection::Truncated(kind) => return Ok(Judgement::Truncated(kind)),
                Detection::Conflict { kind, local } => (kind, local),
            };
            let c = self.conflict(
                first_kind.unwrap_or(kind),
                rel,
                meta,
                found.version(local),
                remote_old.clone(),
                remote_new.clone(),
            );
            let res = Self::classify_row(self.resolve(rel, &c).await?, &c);
            let plan = classify::plan(&facts, local, &res);
            tracing::debug!(relation = %rel.display,
                key = ?remote_new.as_ref().or(remote_old.as_ref()).and_then(|v| key_of(rel, v)),
                op = ?facts.op,
                target = ?facts.target, tombstone = ?facts.tombstone,
                collisions = ?facts.collisions, judged_against = ?local,
                resolution = plan.label, "conflict judged");
            if plan.next {
                first_kind.get_or_insert(kind);
                facts.target_beaten = true;
                continue;
            }
            return Ok(Judgement::Decided(Box::new((c, plan))));
        }
    }

    /// Carries a plan out (except `write: Change` / `AsInsert`, which the
    /// caller does: only it has the statement) and records the compensating
    /// deletes it asks for.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn carry_out(
        &self,
        rel: &LocalRelation,
        meta: &TxnMeta,
        plan: &Plan,
        found: &Found,
        key_params: &[Param],
        incoming: Option<&Value>,
        c: &Conflict,
    ) -> Result<(), ApplyFailure> {
        if let Some(m) = &plan.error {
            return Err(stop(
                rel,
                c,
                incoming.and_then(|v| key_of(rel, v)).as_ref(),
                m,
            ));
        }
        if plan.delete_collisions {
            let vs: Vec<&Version> = found.collisions.iter().collect();
            self.delete_versions(rel, &vs).await?;
        }
        if plan.delete_target
            && let Some(t) = &found.target
        {
            self.delete_versions(rel, &[t]).await?;
        }
        if let Write::Row(v) = &plan.write {
            let over = found.target.as_ref().filter(|_| !plan.delete_target);
            self.write_row(rel, v, over).await?;
        }
        if plan.tombstone && matches!(rel.locator, Locator::Key(_)) {
            self.write_tombstone(rel, key_params).await?;
        }
        // Newer than every version involved, on this node's clock.
        let mut not_before = remote_ts(meta);
        for v in found
            .target
            .iter()
            .chain(&found.collisions)
            .filter_map(|v| v.ts)
        {
            not_before = not_before.max(v);
        }
        let mut keys: Vec<Value> = Vec::new();
        if plan.compensate.incoming {
            keys.extend(incoming.and_then(|v| key_of(rel, v)));
        }
        if plan.compensate.target {
            keys.extend(
                found
                    .target
                    .as_ref()
                    .and_then(|t| t.row.as_ref())
                    .and_then(|r| key_of(rel, r)),
            );
        }
        if plan.compensate.collisions {
            keys.extend(
                found
                    .collisions
                    .iter()
                    .filter_map(|v| v.row.as_ref())
                    .filter_map(|r| key_of(rel, r)),
            );
        }
        for key in keys {
            tracing::info!(relation = %rel.display, key = %key,
                "a row gave way on a unique value to a row at another key: its delete is sent to every node after this transaction commits");
            self.exec(
                rel,
                "INSERT INTO mm.compensations (relid, key, not_before) VALUES ($1::oid, $2::jsonb, $3::timestamptz)",
                &[
                    Param::text(rel.relid.to_string()),
                    Param::text(key.to_string()),
                    Param::text(not_before.to_rfc3339()),
                ],
            )
            .await?;
        }
        Ok(())
    }
}
