//! Merging a group's row changes (`group.rs`) into multi-row statements.
//!
//! Inside a group the apply backend's cost is one statement per row change:
//! ~26 us of backend CPU for an UPDATE, ~44 us for a DELETE with its
//! tombstone, against a few us per row in a 100-row statement. `plan`
//! orders the group's changes into batches of one table and kind, and a
//! batch of inserts, updates or deletes goes out as one statement
//! (`insert_batch`, `sql::fast_update_many`, `sql::fast_delete_many`).
//!
//! Invariant: applying the batches in order leaves every row as applying
//! the changes one by one in commit order would. A change moves ahead of an
//! earlier one only when the two commute: different tables, or the same
//! table and different keys, both tables plain (`lanes_safe`: no trigger
//! that fires on apply, no rule, not partitioned; no unique index besides
//! the key; foreign keys never reach a group). A batch holds each key at most once. What a key cannot tell
//! apart (two spellings of one numeric, a case-insensitive collation, a
//! unique index besides the key) shows as a row missing, a row changed
//! twice, or a unique violation: the merged statement checks it changed
//! every one of its rows, and any failure rolls the group back to be
//! applied again one transaction at a time (`recover.rs`).
//! Conflict checks stay per change: every row carries its own
//! transaction's commit timestamp into `mm.routine`.

use std::collections::HashSet;
use std::sync::Arc;

use mm_proto::pgoutput::{ColumnValue, Insert, Message};

use super::applier::Applier;
use super::fast::{MAX_PARAMS, push_row};
use super::pipeline::{OpKind, Pipeline};
use super::relation::LocalRelation;
use super::sql::{self, Locator};
use super::tuple::{locate, tuple_params};
use super::txn::TxnMeta;
use super::{ApplyFailure, Param};

/// What a batch holds: changes of one kind that one statement can apply
/// together (updates also setting the same columns).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) enum Class {
    Insert,
    Update(Vec<bool>),
    Delete,
    /// Applied on its own (an update of a hot key, with unchanged TOAST,
    /// changing its key; a change located by all columns).
    Alone,
}

/// What `plan` knows of one row change.
#[derive(Debug, Clone)]
pub(super) struct Change {
    pub table: u32,
    pub class: Class,
    /// The row's key (`hot::fingerprint`), when the change touches one
    /// known key only.
    pub key: Option<u64>,
    /// The table may see its changes reordered (`lanes_safe`).
    pub movable: bool,
}

struct Batch {
    table: u32,
    class: Class,
    movable: bool,
    changes: Vec<usize>,
    keys: HashSet<u64>,
    /// Holds a change whose key is not known.
    unkeyed: bool,
}

impl Batch {
    /// Whether `c` may run before everything in this batch.
    fn commutes(&self, c: &Change) -> bool {
        c.movable
            && self.movable
            && (self.table != c.table
                || (!self.unkeyed && c.key.is_some_and(|k| !self.keys.contains(&k))))
    }

    /// Whether `c` may join this batch's statement.
    fn takes(&self, c: &Change) -> bool {
        self.table == c.table
            && self.class == c.class
            && c.class != Class::Alone
            && match c.key {
                Some(k) => !self.keys.contains(&k),
                // Inserts into a table without a key merge in order.
                None => c.class == Class::Insert,
            }
    }
}

/// The group's changes (in commit order) as batches to apply in order,
/// each a list of indexes into `changes`, ascending. A change joins the
/// latest batch of its class it may move up to: every batch after that one
/// must commute with it (the module's invariant); else it starts a new
/// batch at the end.
pub(super) fn plan(changes: &[Change]) -> Vec<Vec<usize>> {
    let mut batches: Vec<Batch> = Vec::new();
    for (i, c) in changes.iter().enumerate() {
        let mut joined = false;
        for b in batches.iter_mut().rev() {
            if b.takes(c) {
                b.changes.push(i);
                b.keys.extend(c.key);
                b.unkeyed |= c.key.is_none();
                joined = true;
                break;
            }
            if !b.commutes(c) {
                break;
            }
        }
        if !joined {
            batches.push(Batch {
                table: c.table,
                class: c.class.clone(),
                movable: c.movable,
                changes: vec![i],
                keys: c.key.into_iter().collect(),
                unkeyed: c.key.is_none(),
            });
        }
    }
    batches.into_iter().map(|b| b.changes).collect()
}

/// Whether `rel`'s changes may be reordered and merged by key: a plain
/// table (`lanes_safe`) whose only unique index is its key. Another unique
/// index here that the publisher lacks could let a reordered change pass
/// where in order it would have met a collision the careful path logs.
fn movable(rel: &LocalRelation) -> bool {
    rel.lanes_safe && rel.unique_indexes.len() <= 1
}

/// Multi-row statement sizes for rows of `width` parameters, within the
/// parameter limit (a size below 2 is not used).
fn many_sizes(width: usize) -> [usize; 2] {
    let most = (MAX_PARAMS - sql::MANY_EXTRA_PARAMS) / width.max(1);
    [100, 10].map(|n| n.min(most))
}

impl Applier {
    /// What `plan` needs of `m`, a row change of a groupable transaction.
    pub(super) fn change_of(&self, m: &Message) -> Result<Change, ApplyFailure> {
        let (oid, class, key) = match m {
            Message::Insert(i) => {
                let rel = self.rel(i.relation_oid)?;
                let key = match rel.locator {
                    Locator::Key(_) => Some(locate(rel, None, Some(&i.new))?.1),
                    Locator::AllColumns(_) => None,
                };
                (i.relation_oid, Class::Insert, key)
            }
            Message::Update(u) => {
                let rel = self.rel(u.relation_oid)?;
                let (_, key) = locate(rel, u.old.as_ref(), Some(&u.new))?;
                let fp = super::hot::fingerprint(u.relation_oid, &key);
                let toast = u
                    .new
                    .columns
                    .iter()
                    .any(|c| matches!(c, ColumnValue::UnchangedToast));
                let keyed = matches!(rel.locator, Locator::Key(_))
                    && !super::careful::key_changed(rel, u, &key);
                let class = if !keyed || toast || self.hot.contains(fp) || !movable(rel) {
                    Class::Alone
                } else {
                    Class::Update(rel.set_mask(&u.new))
                };
                // The hot-key fingerprint is the planner's key too.
                return Ok(Change {
                    table: u.relation_oid,
                    class,
                    key: keyed.then_some(fp),
                    movable: movable(rel),
                });
            }
            Message::Delete(d) => {
                let rel = self.rel(d.relation_oid)?;
                let (_, key) = locate(rel, Some(&d.old), None)?;
                let keyed = matches!(rel.locator, Locator::Key(_));
                let class = if keyed && movable(rel) {
                    Class::Delete
                } else {
                    Class::Alone
                };
                (d.relation_oid, class, keyed.then_some(key))
            }
            _ => {
                return Err(ApplyFailure::new(
                    None,
                    "a group holds row changes only".to_owned(),
                ));
            }
        };
        let movable = movable(self.rel(oid)?);
        Ok(Change {
            table: oid,
            class,
            key: key.map(|k| super::hot::fingerprint(oid, &k)),
            movable,
        })
    }

    /// Applies one `plan` batch of a group: `changes` are (transaction,
    /// change) in commit order, all of one table and class.
    pub(super) async fn queue_batch(
        &mut self,
        pipe: &mut Pipeline,
        changes: Vec<(TxnMeta, &Message)>,
    ) -> Result<(), ApplyFailure> {
        let Some(&(txn0, first)) = changes.first() else {
            return Ok(());
        };
        let (oid, class) = match first {
            Message::Insert(i) => {
                let rows: Vec<Insert> = changes
                    .iter()
                    .filter_map(|(_, m)| match m {
                        Message::Insert(i) => Some(i.clone()),
                        _ => None,
                    })
                    .collect();
                return self.insert_batch(pipe, txn0, i.relation_oid, rows).await;
            }
            Message::Update(u) if changes.len() > 1 => (
                u.relation_oid,
                Class::Update(self.rel(u.relation_oid)?.set_mask(&u.new)),
            ),
            Message::Delete(d) if changes.len() > 1 => (d.relation_oid, Class::Delete),
            _ => return self.queue_alone(pipe, txn0, first).await,
        };
        let rel = self.rel(oid)?;
        let keys = rel.key_remote.len();
        let width = match &class {
            Class::Update(mask) => mask.iter().filter(|s| !**s).count() + keys + 1,
            _ => keys + 1,
        };
        let mut done = 0;
        for n in many_sizes(width) {
            while n >= 2 && changes.len() - done >= n {
                let chunk = &changes[done..done + n];
                done += n;
                let rel = self.rel(oid)?;
                let mut params = Vec::with_capacity(width * n + sql::MANY_EXTRA_PARAMS);
                for (txn, m) in chunk {
                    match m {
                        Message::Update(u) => {
                            // One mask for the batch: its class.
                            let mask = match &class {
                                Class::Update(m) => Some(m.as_slice()),
                                _ => None,
                            };
                            params.extend(tuple_params(&u.new, rel, mask)?);
                            params.extend(locate(rel, u.old.as_ref(), Some(&u.new))?.1);
                        }
                        Message::Delete(d) => params.extend(locate(rel, Some(&d.old), None)?.1),
                        _ => {}
                    }
                    params.push(Param::timestamptz(txn.commit_ts.0));
                }
                // Only deletes write tombstones: an update's statement is
                // one, whatever the table's tombstone mode (not prepared
                // again when the mode changes).
                let tombstones = match class {
                    Class::Delete => self.tombstone_write(rel),
                    _ => sql::TombstoneWrite::Insert,
                };
                let stmt = match rel.many.get(&(class.clone(), n, tombstones)) {
                    Some(s) => s.clone(),
                    None => {
                        let text = many_sql(rel, &class, n, tombstones);
                        let display = Arc::clone(&rel.display);
                        let s = pipe.prepare(&self.stmt_names, &display, &text).await?;
                        self.rel_mut(oid)?
                            .many
                            .insert((class.clone(), n, tombstones), s.clone());
                        s
                    }
                };
                // The guard's shared parameters: the same for every
                // transaction of a group.
                let [peers, _, wm_ids, wm_ts] = self.guard_params(&txn0).params(false);
                params.extend([peers, wm_ids, wm_ts]);
                let kind = match class {
                    Class::Delete => OpKind::Delete,
                    _ => OpKind::Update,
                };
                let display = Arc::clone(&self.rel(oid)?.display);
                push_row(
                    n as u64,
                    pipe,
                    &stmt,
                    params,
                    kind,
                    display,
                    chunk[0].0,
                    sql::Commit::Later,
                )
                .await?;
            }
        }
        for &(txn, m) in &changes[done..] {
            self.queue_alone(pipe, txn, m).await?;
        }
        Ok(())
    }

    /// One update or delete of a group in a statement of its own.
    async fn queue_alone(
        &mut self,
        pipe: &mut Pipeline,
        txn: TxnMeta,
        m: &Message,
    ) -> Result<(), ApplyFailure> {
        let guard = self.guard_params(&txn);
        match m {
            Message::Update(u) => self.update(pipe, txn, &guard, u.clone(), None).await,
            Message::Delete(d) => self.delete(pipe, txn, &guard, d.clone(), None).await,
            _ => Ok(()),
        }
    }
}

/// The merged statement of `rows` changes of `class` into `rel`.
fn many_sql(
    rel: &LocalRelation,
    class: &Class,
    rows: usize,
    tombstones: sql::TombstoneWrite,
) -> String {
    let keys = rel.key_names().unwrap_or_default();
    match class {
        Class::Update(mask) => {
            let (cols, types): (Vec<&str>, Vec<&str>) = rel
                .local_names
                .iter()
                .zip(&rel.local_types)
                .zip(mask)
                .filter(|(_, skip)| !**skip)
                .map(|((c, t), _)| (c.as_str(), t.as_str()))
                .unzip();
            sql::fast_update_many(&rel.table_sql, &cols, &types, &keys, &rel.key_types(), rows)
        }
        _ => sql::fast_delete_many(
            &rel.table_sql,
            &keys,
            &rel.key_types(),
            rel.relid,
            rows,
            tombstones,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ch(table: u32, class: Class, key: Option<u64>) -> Change {
        Change {
            table,
            class,
            key,
            movable: true,
        }
    }

    fn upd() -> Class {
        Class::Update(vec![false, false])
    }

    #[test]
    fn an_update_and_an_insert_per_transaction_become_two_statements() {
        // TPC-B's shape: each transaction updates one table, appends to
        // another.
        let changes: Vec<Change> = (0..50)
            .flat_map(|k| [ch(1, upd(), Some(k)), ch(2, Class::Insert, Some(k))])
            .collect();
        let b = plan(&changes);
        assert_eq!(b.len(), 2);
        assert_eq!(b[0], (0..50).map(|k| 2 * k).collect::<Vec<_>>());
        assert_eq!(b[1], (0..50).map(|k| 2 * k + 1).collect::<Vec<_>>());
    }

    #[test]
    fn a_key_met_again_keeps_its_order() {
        // Update key 7, insert key 1, update 7 again, insert key 2: the
        // second update stays after the first, the inserts may join.
        let changes = vec![
            ch(1, upd(), Some(7)),
            ch(2, Class::Insert, Some(1)),
            ch(1, upd(), Some(7)),
            ch(2, Class::Insert, Some(2)),
        ];
        assert_eq!(plan(&changes), vec![vec![0], vec![1, 3], vec![2]]);
        // A delete then an insert of the same key: never the other way.
        let changes = vec![
            ch(1, Class::Delete, Some(7)),
            ch(1, Class::Insert, Some(7)),
            ch(1, Class::Delete, Some(8)),
        ];
        assert_eq!(plan(&changes), vec![vec![0, 2], vec![1]]);
        // An insert then an update of what it inserted: the update after.
        let changes = vec![
            ch(1, Class::Insert, Some(7)),
            ch(1, upd(), Some(7)),
            ch(1, Class::Insert, Some(8)),
        ];
        assert_eq!(plan(&changes), vec![vec![0, 2], vec![1]]);
    }

    #[test]
    fn changes_that_cannot_be_told_apart_stay_in_order() {
        // A table with triggers (not movable): nothing moves across its
        // changes, consecutive inserts still merge.
        let fixed = |class, key| Change {
            movable: false,
            ..ch(3, class, key)
        };
        let changes = vec![
            fixed(Class::Insert, Some(1)),
            fixed(Class::Insert, Some(2)),
            ch(1, upd(), Some(1)),
            fixed(Class::Insert, Some(3)),
            ch(1, upd(), Some(2)),
        ];
        assert_eq!(plan(&changes), vec![vec![0, 1], vec![2], vec![3], vec![4]]);
        // A change without a known key: nothing of its table moves across it.
        let changes = vec![
            ch(1, upd(), Some(1)),
            ch(1, Class::Alone, None),
            ch(1, upd(), Some(2)),
            ch(2, Class::Insert, Some(1)),
        ];
        assert_eq!(plan(&changes), vec![vec![0], vec![1], vec![2], vec![3]]);
        // An update setting other columns does not join.
        let changes = vec![
            ch(1, upd(), Some(1)),
            ch(1, Class::Update(vec![false, true]), Some(2)),
            ch(1, upd(), Some(3)),
        ];
        assert_eq!(plan(&changes), vec![vec![0, 2], vec![1]]);
    }

    #[test]
    fn merged_statements_stay_within_the_parameter_limit() {
        assert_eq!(many_sizes(3), [100, 10]);
        assert_eq!(many_sizes(1000), [65, 10]);
        for w in [1, 3, 655, 1600, 40000] {
            for n in many_sizes(w) {
                assert!(n < 2 || n * w + sql::MANY_EXTRA_PARAMS <= MAX_PARAMS);
            }
        }
    }
}
