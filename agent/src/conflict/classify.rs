//! The conflict rules as two pure functions: `detect` (is there a conflict,
//! of which type, against which local version) and `plan` (given the
//! resolver's decision, what happens to which rows). The careful path
//! (`apply/careful/`) gathers the facts under row locks, asks the resolver
//! and carries the plan out; it decides nothing itself. Each rule is a row
//! of the conflict table in docs/ARCHITECTURE.md, tested below row by row.
//!
//! Convergence rests on three things these rules keep:
//! - per key, last writer wins over every version the key ever had: live
//!   rows, tombstones (deletes, and the old key of a key change: a key
//!   change is a delete of the old key and an insert of the new one, each
//!   judged on its own key) and the table's truncate;
//! - a row given up because ANOTHER row holds one of its unique values
//!   (a secondary unique key) is deleted on every node by a compensating
//!   delete, newer than both versions, which this node sends after the
//!   transaction commits (`Plan::compensate`). Per-key rules alone cannot
//!   converge there: a node that never sees both rows at once keeps both;
//! - nothing here depends on arrival order beyond what the versions say.

use chrono::{DateTime, Utc};

use super::{ConflictType, Resolution};

/// A local version (row, tombstone or truncate) as the rules see it.
#[derive(Debug, Clone, PartialEq)]
pub struct Seen {
    /// No resolver needed against it (`routine::no_resolver_needed`).
    pub routine: bool,
    pub ts: Option<DateTime<Utc>>,
    /// Node that wrote it.
    pub origin: Option<String>,
}

impl Seen {
    /// Last-writer order: (commit timestamp, node name); unknown is oldest.
    fn rank(&self) -> (Option<DateTime<Utc>>, Option<&str>) {
        (self.ts, self.origin.as_deref())
    }
}

/// The incoming row change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Insert,
    /// An update that keeps the key.
    Update,
    Delete,
    /// The new key of an update that changed it: an insert at that key.
    MovedIn,
    /// The old key of an update that changed it: a delete of that key.
    MovedOut,
}

/// What the careful path found, under locks, for one change.
#[derive(Debug, Clone, PartialEq)]
pub struct Facts {
    pub op: Op,
    /// The row at the change's key (the new key for inserts).
    pub target: Option<Seen>,
    /// That key's tombstone, when no row is there.
    pub tombstone: Option<Seen>,
    /// Other rows holding one of the new row's unique values.
    pub collisions: Vec<Seen>,
    /// The table was truncated at or after the change (and not by it).
    pub truncated: bool,
    /// The change already won against the target (second stage).
    pub target_beaten: bool,
}

/// The local version a conflict is judged against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Local {
    Target,
    Tombstone,
    Collision(usize),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detection {
    /// No resolver needed: carry the change out as it is.
    Apply,
    /// Older than the table's truncate: discarded whatever the resolver,
    /// logged as this type against the truncate (`keep_local`).
    Truncated(ConflictType),
    Conflict {
        kind: ConflictType,
        local: Local,
    },
}

/// Detection: PostgreSQL 18's conflict types (docs/ARCHITECTURE.md). A
/// change is judged against the row at its own key first, then (if it won
/// there: `Facts::target_beaten`) against the rows holding its unique values.
pub fn detect(f: &Facts) -> Detection {
    let inserting = matches!(f.op, Op::Insert | Op::MovedIn);
    if f.truncated && (inserting || f.target.is_none()) {
        return Detection::Truncated(match f.op {
            Op::Insert => ConflictType::InsertExists,
            Op::Update | Op::MovedIn | Op::MovedOut => ConflictType::UpdateDeleted,
            Op::Delete => ConflictType::DeleteMissing,
        });
    }
    let conflict = |kind, local| Detection::Conflict { kind, local };
    let exists = if f.op == Op::Insert {
        ConflictType::InsertExists
    } else {
        ConflictType::UpdateExists
    };
    // Against the newest row in the way: last-writer-wins then applies the
    // change only if it beats every one.
    let collisions = || {
        let newest = (0..f.collisions.len())
            .max_by(|&a, &b| f.collisions[a].rank().cmp(&f.collisions[b].rank()))
            .unwrap_or(0);
        let kind = if f.collisions.len() > 1 {
            ConflictType::MultipleUniqueConflicts
        } else {
            exists
        };
        conflict(kind, Local::Collision(newest))
    };
    match f.op {
        Op::Insert | Op::MovedIn => {
            if f.target.is_some() && !f.target_beaten {
                let kind = if f.collisions.is_empty() {
                    exists
                } else {
                    ConflictType::MultipleUniqueConflicts
                };
                return conflict(kind, Local::Target);
            }
            if !f.collisions.is_empty() {
                // The key's own tombstone counts too: a row deleted after
                // this insert stays deleted, whatever else holds its
                // unique values (judged against the collision alone, the
                // insert won here and lost where the delete came later).
                if let (Some(t), None) = (&f.tombstone, &f.target)
                    && !t.routine
                    && f.collisions.iter().all(|c| t.rank() > c.rank())
                    && let Detection::Conflict { kind, .. } = collisions()
                {
                    return conflict(kind, Local::Tombstone);
                }
                return collisions();
            }
            match &f.tombstone {
                Some(t) if !t.routine && f.target.is_none() => conflict(
                    if f.op == Op::Insert {
                        ConflictType::InsertExists
                    } else {
                        ConflictType::UpdateDeleted
                    },
                    Local::Tombstone,
                ),
                _ => Detection::Apply,
            }
        }
        Op::Update => match &f.target {
            None => conflict(
                if f.tombstone.is_some() {
                    ConflictType::UpdateDeleted
                } else {
                    ConflictType::UpdateMissing
                },
                Local::Tombstone,
            ),
            Some(t) if !t.routine && !f.target_beaten => {
                conflict(ConflictType::UpdateOriginDiffers, Local::Target)
            }
            Some(_) if !f.collisions.is_empty() => collisions(),
            Some(_) => Detection::Apply,
        },
        Op::Delete | Op::MovedOut => match &f.target {
            Some(t) if t.routine => Detection::Apply,
            Some(_) => conflict(
                if f.op == Op::Delete {
                    ConflictType::DeleteOriginDiffers
                } else {
                    ConflictType::UpdateOriginDiffers
                },
                Local::Target,
            ),
            None => conflict(
                match (f.op, f.tombstone.is_some()) {
                    (Op::Delete, _) => ConflictType::DeleteMissing,
                    (_, true) => ConflictType::UpdateDeleted,
                    (_, false) => ConflictType::UpdateMissing,
                },
                Local::Tombstone,
            ),
        },
    }
}

/// What is written in place of the target (or as a new row).
#[derive(Debug, Clone, PartialEq)]
pub enum Write {
    Nothing,
    /// The incoming change itself: an insert, or an update of the target.
    Change,
    /// An update of a missing row wins: it becomes an insert of its new row,
    /// which is judged again as one (`Op::MovedIn`), its tombstone beaten.
    AsInsert,
    /// The resolver's row, over the target if it stays, else inserted.
    Row(serde_json::Value),
}

/// The resolution, carried out.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub delete_target: bool,
    pub delete_collisions: bool,
    pub write: Write,
    /// Raise the key's tombstone to this change's version.
    pub tombstone: bool,
    /// Compensating deletes to send after commit (see the module doc).
    pub compensate: Compensate,
    /// `mm.conflict_log.resolution`.
    pub label: &'static str,
    /// The resolver stopped the stream.
    pub error: Option<String>,
    /// Won against the target, but rows at other keys hold its unique
    /// values: judge it again against them (`target_beaten`) before
    /// carrying anything out. One conflict is logged for both decisions:
    /// the first one's type, the second one's versions and outcome.
    pub next: bool,
}

/// Which keys get a compensating delete.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Compensate {
    /// The incoming row's key (insert): it lost to another key's row.
    pub incoming: bool,
    /// The target's key: its new version lost to another key's row.
    pub target: bool,
    /// The collisions' keys: they lost to the incoming row.
    pub collisions: bool,
}

impl Plan {
    fn new(label: &'static str) -> Self {
        Plan {
            delete_target: false,
            delete_collisions: false,
            write: Write::Nothing,
            tombstone: false,
            compensate: Compensate::default(),
            label,
            error: None,
            next: false,
        }
    }
}

/// The plan for a change that needs no resolver.
pub fn plan_routine(f: &Facts) -> Plan {
    match f.op {
        Op::Insert | Op::MovedIn | Op::Update => Plan {
            write: Write::Change,
            ..Plan::new("apply_remote")
        },
        Op::Delete | Op::MovedOut => Plan {
            delete_target: f.target.is_some(),
            tombstone: true,
            ..Plan::new("apply_remote")
        },
    }
}

/// The plan for a conflict `local` was judged against, given the
/// resolver's decision.
pub fn plan(f: &Facts, local: Local, r: &Resolution) -> Plan {
    let lost_to_other_key = matches!(local, Local::Collision(_));
    let has_target = f.target.is_some();
    let has_collisions = !f.collisions.is_empty();
    if let Resolution::Error(m) = r {
        return Plan {
            error: Some(m.clone()),
            ..Plan::new("error")
        };
    }
    if local == Local::Target
        && has_collisions
        && *r == Resolution::ApplyRemote
        && matches!(f.op, Op::Insert | Op::MovedIn | Op::Update)
    {
        return Plan {
            next: true,
            ..Plan::new("apply_remote")
        };
    }
    match f.op {
        Op::Insert | Op::MovedIn => match r {
            Resolution::ApplyRemote => Plan {
                delete_target: has_target,
                ..winning(has_collisions, Write::Change, "apply_remote")
            },
            // Lost to a row at another key: the incoming row cannot be
            // stored here, and whatever this node had at its key is older
            // than it (it beat the target, or the newest was another row).
            Resolution::KeepLocal if lost_to_other_key => Plan {
                delete_target: has_target,
                tombstone: true,
                compensate: Compensate {
                    incoming: true,
                    ..Compensate::default()
                },
                ..Plan::new(if has_target { "deleted" } else { "keep_local" })
            },
            Resolution::KeepLocal => Plan::new("keep_local"),
            Resolution::Row(v) => Plan {
                delete_target: has_target,
                ..winning(has_collisions, Write::Row(v.clone()), "merged")
            },
            Resolution::NoRow => Plan {
                delete_target: has_target,
                tombstone: true,
                ..winning(
                    has_collisions,
                    Write::Nothing,
                    if has_target || has_collisions {
                        "deleted"
                    } else {
                        "keep_local"
                    },
                )
            },
            Resolution::Error(_) => unreachable_plan(),
        },
        Op::Update if !has_target => match r {
            Resolution::ApplyRemote => Plan {
                write: Write::AsInsert,
                ..Plan::new("apply_remote")
            },
            Resolution::Row(v) => Plan {
                write: Write::Row(v.clone()),
                ..Plan::new("merged")
            },
            _ => Plan::new("keep_local"),
        },
        Op::Update => match r {
            Resolution::ApplyRemote => winning(has_collisions, Write::Change, "apply_remote"),
            // The update lost to a row at another key holding the unique
            // value it moved onto: its row cannot take the new version and
            // its old version is older than the one lost (the origin no
            // longer has it), so it goes, here and everywhere.
            Resolution::KeepLocal if lost_to_other_key => Plan {
                delete_target: true,
                tombstone: true,
                compensate: Compensate {
                    target: true,
                    ..Compensate::default()
                },
                ..Plan::new("deleted")
            },
            Resolution::KeepLocal => Plan::new("keep_local"),
            Resolution::Row(v) => winning(has_collisions, Write::Row(v.clone()), "merged"),
            Resolution::NoRow => Plan {
                delete_target: true,
                tombstone: true,
                compensate: Compensate {
                    target: lost_to_other_key,
                    ..Compensate::default()
                },
                ..Plan::new("deleted")
            },
            Resolution::Error(_) => unreachable_plan(),
        },
        Op::Delete | Op::MovedOut => match r {
            Resolution::ApplyRemote => Plan {
                delete_target: has_target,
                tombstone: true,
                ..Plan::new("apply_remote")
            },
            Resolution::NoRow => Plan {
                delete_target: has_target,
                tombstone: true,
                ..Plan::new(if has_target { "deleted" } else { "keep_local" })
            },
            Resolution::KeepLocal => Plan::new("keep_local"),
            Resolution::Row(v) => Plan {
                write: Write::Row(v.clone()),
                ..Plan::new("merged")
            },
            Resolution::Error(_) => unreachable_plan(),
        },
    }
}

/// The change (or the resolver's row) takes the unique values: the rows at
/// other keys holding them go, here and everywhere.
fn winning(has_collisions: bool, write: Write, label: &'static str) -> Plan {
    Plan {
        delete_collisions: has_collisions,
        write,
        compensate: Compensate {
            collisions: has_collisions,
            ..Compensate::default()
        },
        ..Plan::new(label)
    }
}

/// `Resolution::Error` returns before the match; kept total without a panic.
fn unreachable_plan() -> Plan {
    Plan {
        error: Some("internal: error resolution not handled".into()),
        ..Plan::new("error")
    }
}

#[cfg(test)]
mod tests;
