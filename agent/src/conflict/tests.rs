use chrono::TimeZone;

use super::*;

fn at(s: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_800_000_000 + s, 0)
        .single()
        .expect("valid")
}

fn conflict(local: Option<(&str, Option<i64>)>, remote: (&str, i64)) -> Conflict {
    Conflict {
        kind: ConflictType::UpdateOriginDiffers,
        relation: "public.t".into(),
        local: None,
        remote_old: None,
        remote_new: None,
        local_origin: local.map(|(n, _)| n.to_owned()),
        local_commit_ts: local.and_then(|(_, t)| t.map(at)),
        remote_origin: remote.0.into(),
        remote_commit_ts: at(remote.1),
    }
}

#[test]
fn last_writer_wins_by_timestamp_then_node_name() {
    let lww = LastWriterWins;
    assert_eq!(
        lww.resolve(&conflict(Some(("a", Some(1))), ("b", 2))),
        Resolution::ApplyRemote
    );
    assert_eq!(
        lww.resolve(&conflict(Some(("a", Some(3))), ("b", 2))),
        Resolution::KeepLocal
    );
    // Equal timestamps: the higher node name wins, on both nodes.
    assert_eq!(
        lww.resolve(&conflict(Some(("a", Some(2))), ("b", 2))),
        Resolution::ApplyRemote
    );
    assert_eq!(
        lww.resolve(&conflict(Some(("b", Some(2))), ("a", 2))),
        Resolution::KeepLocal
    );
    // No local version, or one with an unknown timestamp: the incoming wins.
    assert_eq!(
        lww.resolve(&conflict(None, ("a", 0))),
        Resolution::ApplyRemote
    );
    assert_eq!(
        lww.resolve(&conflict(Some(("z", None)), ("a", 0))),
        Resolution::ApplyRemote
    );
}

#[test]
fn first_writer_wins_is_the_mirror_image() {
    let fww = FirstWriterWins;
    assert_eq!(
        fww.resolve(&conflict(Some(("a", Some(1))), ("b", 2))),
        Resolution::KeepLocal
    );
    assert_eq!(
        fww.resolve(&conflict(Some(("a", Some(3))), ("b", 2))),
        Resolution::ApplyRemote
    );
    assert_eq!(
        fww.resolve(&conflict(None, ("a", 0))),
        Resolution::ApplyRemote
    );
}

#[test]
fn both_nodes_of_a_conflict_pick_the_same_winner() {
    // Node a sees b's change against its own version and vice versa.
    for (ta, tb) in [(1, 2), (2, 1), (5, 5)] {
        let on_a = LastWriterWins.resolve(&conflict(Some(("a", Some(ta))), ("b", tb)));
        let on_b = LastWriterWins.resolve(&conflict(Some(("b", Some(tb))), ("a", ta)));
        let winner_on_a = if on_a == Resolution::ApplyRemote {
            "b"
        } else {
            "a"
        };
        let winner_on_b = if on_b == Resolution::ApplyRemote {
            "a"
        } else {
            "b"
        };
        assert_eq!(winner_on_a, winner_on_b, "ts a={ta} b={tb}");
    }
}

#[test]
fn registry_refuses_unknown_custom_resolvers() {
    let mut reg = ResolverRegistry::builtin();
    let spec = mm_cluster_config::ResolverSpec::Custom("mine".into());
    assert!(reg.choose(&spec).is_err());
    reg.register("mine", std::sync::Arc::new(KeepLocal));
    assert!(matches!(reg.choose(&spec), Ok(ResolverChoice::Rust(_))));
    let t = TableResolvers::from_config(
        &reg,
        "last_writer_wins",
        &[("public.t".to_owned(), "sql:app.f".to_owned())]
            .into_iter()
            .collect(),
    )
    .expect("valid");
    assert!(matches!(
        t.for_table("public.t"),
        ResolverChoice::Sql { function } if function == "\"app\".\"f\""
    ));
    assert!(matches!(t.for_table("public.u"), ResolverChoice::Rust(_)));
}
