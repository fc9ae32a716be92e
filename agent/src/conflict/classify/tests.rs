//! The conflict table of docs/ARCHITECTURE.md, row by row, without
//! PostgreSQL: detection (type, judged against what), then the plan under
//! last-writer-wins' two outcomes.

use chrono::TimeZone;

use super::*;

fn at(s: i64) -> Option<DateTime<Utc>> {
    Utc.timestamp_opt(1_800_000_000 + s, 0).single()
}

fn seen(routine: bool, ts: i64, origin: &str) -> Seen {
    Seen {
        routine,
        ts: at(ts),
        origin: Some(origin.into()),
    }
}

fn facts(op: Op) -> Facts {
    Facts {
        op,
        target: None,
        tombstone: None,
        collisions: Vec::new(),
        truncated: false,
        target_beaten: false,
    }
}

fn conflict(kind: ConflictType, local: Local) -> Detection {
    Detection::Conflict { kind, local }
}

#[test]
fn insert_into_a_free_key_applies() {
    assert_eq!(detect(&facts(Op::Insert)), Detection::Apply);
    let f = Facts {
        tombstone: Some(seen(true, 1, "a")),
        ..facts(Op::Insert)
    };
    assert_eq!(
        detect(&f),
        Detection::Apply,
        "a tombstone the publisher saw"
    );
}

#[test]
fn insert_over_a_tombstone_the_publisher_did_not_see_is_insert_exists() {
    let f = Facts {
        tombstone: Some(seen(false, 5, "a")),
        ..facts(Op::Insert)
    };
    assert_eq!(
        detect(&f),
        conflict(ConflictType::InsertExists, Local::Tombstone)
    );
    let p = plan(&f, Local::Tombstone, &Resolution::KeepLocal);
    assert_eq!((p.write.clone(), p.label), (Write::Nothing, "keep_local"));
    let p = plan(&f, Local::Tombstone, &Resolution::ApplyRemote);
    assert_eq!(p.write, Write::Change);
    assert_eq!(p.compensate, Compensate::default());
}

#[test]
fn insert_over_a_taken_key_replaces_it_or_is_skipped_without_compensation() {
    let f = Facts {
        target: Some(seen(true, 1, "a")),
        ..facts(Op::Insert)
    };
    assert_eq!(
        detect(&f),
        conflict(ConflictType::InsertExists, Local::Target)
    );
    let p = plan(&f, Local::Target, &Resolution::ApplyRemote);
    assert!(p.delete_target && p.write == Write::Change && !p.next);
    assert_eq!(p.compensate, Compensate::default(), "same key: plain LWW");
    let p = plan(&f, Local::Target, &Resolution::KeepLocal);
    assert!(!p.delete_target && p.write == Write::Nothing);
}

#[test]
fn insert_colliding_with_another_keys_row_compensates_the_loser() {
    let f = Facts {
        collisions: vec![seen(false, 3, "b")],
        ..facts(Op::Insert)
    };
    assert_eq!(
        detect(&f),
        conflict(ConflictType::InsertExists, Local::Collision(0))
    );
    let won = plan(&f, Local::Collision(0), &Resolution::ApplyRemote);
    assert!(won.delete_collisions && won.write == Write::Change);
    assert_eq!(
        won.compensate,
        Compensate {
            collisions: true,
            ..Compensate::default()
        }
    );
    let lost = plan(&f, Local::Collision(0), &Resolution::KeepLocal);
    assert_eq!(lost.write, Write::Nothing);
    assert!(lost.compensate.incoming && lost.tombstone);
    assert_eq!(lost.label, "keep_local");
}

/// Seen as a divergence (MM_SEED=970135483): node B deleted row 1 after
/// node A inserted it; on B, A's older insert collided with another row's
/// unique value, won against that row alone and brought row 1 back, while
/// A applied B's delete. The later tombstone must win there too.
#[test]
fn an_insert_colliding_elsewhere_still_loses_to_its_keys_later_tombstone() {
    let f = Facts {
        tombstone: Some(seen(false, 9, "b")),
        collisions: vec![seen(false, 3, "b")],
        ..facts(Op::Insert)
    };
    assert_eq!(
        detect(&f),
        conflict(ConflictType::InsertExists, Local::Tombstone)
    );
    let lost = plan(&f, Local::Tombstone, &Resolution::KeepLocal);
    assert_eq!(lost.write, Write::Nothing);
    assert!(!lost.delete_collisions);
    // Won against the tombstone, it won against every collision too.
    let won = plan(&f, Local::Tombstone, &Resolution::ApplyRemote);
    assert!(won.delete_collisions && won.write == Write::Change);
    // An older tombstone, or one the publisher saw: the collision decides.
    for t in [seen(false, 1, "b"), seen(true, 9, "b")] {
        let f = Facts {
            tombstone: Some(t),
            ..f.clone()
        };
        assert_eq!(
            detect(&f),
            conflict(ConflictType::InsertExists, Local::Collision(0))
        );
    }
}

#[test]
fn a_taken_key_is_judged_first_then_the_unique_values() {
    let mut f = Facts {
        target: Some(seen(false, 2, "a")),
        collisions: vec![seen(false, 4, "b")],
        ..facts(Op::Insert)
    };
    assert_eq!(
        detect(&f),
        conflict(ConflictType::MultipleUniqueConflicts, Local::Target)
    );
    let p = plan(&f, Local::Target, &Resolution::ApplyRemote);
    assert!(p.next, "won at its key: now the other rows");
    f.target_beaten = true;
    assert_eq!(
        detect(&f),
        conflict(ConflictType::InsertExists, Local::Collision(0))
    );
    // Beat the target, lost to the other row: the key's old row goes too.
    let p = plan(&f, Local::Collision(0), &Resolution::KeepLocal);
    assert!(p.delete_target && p.compensate.incoming);
    assert_eq!(p.label, "deleted");
}

#[test]
fn several_collisions_are_judged_against_the_newest() {
    let f = Facts {
        collisions: vec![
            seen(false, 3, "b"),
            seen(false, 9, "a"),
            seen(false, 9, "c"),
        ],
        ..facts(Op::Insert)
    };
    assert_eq!(
        detect(&f),
        conflict(ConflictType::MultipleUniqueConflicts, Local::Collision(2))
    );
}

#[test]
fn update_of_a_routine_version_applies() {
    let f = Facts {
        target: Some(seen(true, 1, "a")),
        ..facts(Op::Update)
    };
    assert_eq!(detect(&f), Detection::Apply);
    assert_eq!(plan_routine(&f).write, Write::Change);
}

#[test]
fn update_of_a_concurrent_version_is_update_origin_differs() {
    let f = Facts {
        target: Some(seen(false, 1, "a")),
        ..facts(Op::Update)
    };
    assert_eq!(
        detect(&f),
        conflict(ConflictType::UpdateOriginDiffers, Local::Target)
    );
    let p = plan(&f, Local::Target, &Resolution::KeepLocal);
    assert_eq!((p.write.clone(), p.delete_target), (Write::Nothing, false));
    let p = plan(&f, Local::Target, &Resolution::ApplyRemote);
    assert_eq!(p.write, Write::Change);
}

#[test]
fn update_onto_another_rows_unique_value_is_update_exists() {
    let f = Facts {
        target: Some(seen(true, 1, "a")),
        collisions: vec![seen(false, 5, "b")],
        ..facts(Op::Update)
    };
    assert_eq!(
        detect(&f),
        conflict(ConflictType::UpdateExists, Local::Collision(0))
    );
    let lost = plan(&f, Local::Collision(0), &Resolution::KeepLocal);
    assert!(lost.delete_target && lost.tombstone && lost.compensate.target);
    assert_eq!(lost.label, "deleted");
    let won = plan(&f, Local::Collision(0), &Resolution::ApplyRemote);
    assert!(won.delete_collisions && won.compensate.collisions && !won.delete_target);
    assert_eq!(won.write, Write::Change);
}

#[test]
fn a_concurrent_target_and_a_collision_take_two_decisions() {
    let mut f = Facts {
        target: Some(seen(false, 3, "a")),
        collisions: vec![seen(false, 5, "b")],
        ..facts(Op::Update)
    };
    assert_eq!(
        detect(&f),
        conflict(ConflictType::UpdateOriginDiffers, Local::Target)
    );
    // Lost to the target: nothing moves, no other row is touched.
    let p = plan(&f, Local::Target, &Resolution::KeepLocal);
    assert!(!p.delete_target && !p.delete_collisions && p.compensate == Compensate::default());
    assert!(plan(&f, Local::Target, &Resolution::ApplyRemote).next);
    f.target_beaten = true;
    assert_eq!(
        detect(&f),
        conflict(ConflictType::UpdateExists, Local::Collision(0))
    );
}

#[test]
fn update_of_a_missing_row() {
    let gone = Facts {
        tombstone: Some(seen(false, 2, "b")),
        ..facts(Op::Update)
    };
    assert_eq!(
        detect(&gone),
        conflict(ConflictType::UpdateDeleted, Local::Tombstone)
    );
    assert_eq!(
        detect(&facts(Op::Update)),
        conflict(ConflictType::UpdateMissing, Local::Tombstone)
    );
    assert_eq!(
        plan(&gone, Local::Tombstone, &Resolution::ApplyRemote).write,
        Write::AsInsert
    );
    assert_eq!(
        plan(&gone, Local::Tombstone, &Resolution::KeepLocal).write,
        Write::Nothing
    );
}

#[test]
fn deletes() {
    let routine = Facts {
        target: Some(seen(true, 1, "a")),
        ..facts(Op::Delete)
    };
    assert_eq!(detect(&routine), Detection::Apply);
    let p = plan_routine(&routine);
    assert!(p.delete_target && p.tombstone);
    let concurrent = Facts {
        target: Some(seen(false, 1, "a")),
        ..facts(Op::Delete)
    };
    assert_eq!(
        detect(&concurrent),
        conflict(ConflictType::DeleteOriginDiffers, Local::Target)
    );
    assert!(!plan(&concurrent, Local::Target, &Resolution::KeepLocal).delete_target);
    let missing = facts(Op::Delete);
    assert_eq!(
        detect(&missing),
        conflict(ConflictType::DeleteMissing, Local::Tombstone)
    );
    let p = plan(&missing, Local::Tombstone, &Resolution::ApplyRemote);
    assert!(p.tombstone && !p.delete_target);
    assert_eq!(p.label, "apply_remote");
}

#[test]
fn changes_older_than_the_tables_truncate_are_discarded() {
    let f = Facts {
        truncated: true,
        ..facts(Op::Insert)
    };
    assert_eq!(detect(&f), Detection::Truncated(ConflictType::InsertExists));
    let f = Facts {
        truncated: true,
        ..facts(Op::Delete)
    };
    assert_eq!(
        detect(&f),
        Detection::Truncated(ConflictType::DeleteMissing)
    );
    let f = Facts {
        truncated: true,
        ..facts(Op::Update)
    };
    assert_eq!(
        detect(&f),
        Detection::Truncated(ConflictType::UpdateDeleted)
    );
    // A row that survived the truncate is newer than it: judged as usual.
    let f = Facts {
        truncated: true,
        target: Some(seen(false, 9, "a")),
        ..facts(Op::Update)
    };
    assert_eq!(
        detect(&f),
        conflict(ConflictType::UpdateOriginDiffers, Local::Target)
    );
}

#[test]
fn a_key_change_is_a_delete_of_the_old_key_and_an_insert_at_the_new() {
    let out = Facts {
        target: Some(seen(false, 9, "b")),
        ..facts(Op::MovedOut)
    };
    assert_eq!(
        detect(&out),
        conflict(ConflictType::UpdateOriginDiffers, Local::Target)
    );
    // A newer change to the old row keeps it here; the new key still gets
    // the moved row (judged on its own key).
    assert!(!plan(&out, Local::Target, &Resolution::KeepLocal).delete_target);
    let gone = Facts {
        tombstone: Some(seen(false, 9, "b")),
        ..facts(Op::MovedOut)
    };
    assert_eq!(
        detect(&gone),
        conflict(ConflictType::UpdateDeleted, Local::Tombstone)
    );
    let moved_in = Facts {
        target: Some(seen(true, 1, "a")),
        ..facts(Op::MovedIn)
    };
    assert_eq!(
        detect(&moved_in),
        conflict(ConflictType::UpdateExists, Local::Target)
    );
    let deleted_later = Facts {
        tombstone: Some(seen(false, 9, "c")),
        ..facts(Op::MovedIn)
    };
    assert_eq!(
        detect(&deleted_later),
        conflict(ConflictType::UpdateDeleted, Local::Tombstone)
    );
}

#[test]
fn an_error_resolution_stops_with_its_message() {
    let f = Facts {
        target: Some(seen(false, 1, "a")),
        ..facts(Op::Update)
    };
    let p = plan(&f, Local::Target, &Resolution::Error("no".into()));
    assert_eq!(p.error.as_deref(), Some("no"));
    assert_eq!(p.write, Write::Nothing);
}
