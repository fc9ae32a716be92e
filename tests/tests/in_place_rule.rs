//! Last-writer-wins exists twice for `update_origin_differs`: the careful
//! path asks `LastWriterWins::resolve` (Rust), and an update of a key that
//! just conflicted settles the same conflict inside its own statement
//! (`sql::fast_update_in_place`, the rule written in SQL). Both must decide
//! the same for every local version and every incoming change, and log the
//! same conflict: this runs the real statement on real PostgreSQL against
//! rows written under different replication origins with chosen commit
//! timestamps (equal ones too, where the node name decides) and compares
//! its outcome with the Rust resolver's.

use anyhow::{Context, Result, ensure};
use chrono::{DateTime, Utc};
use mm_agent::apply::Param;
use mm_agent::apply::sql::{Commit, fast_update_in_place};
use mm_agent::conflict::routine::{VersionFacts, no_resolver_needed};
use mm_agent::conflict::{Conflict, ConflictType, LastWriterWins, Resolution, Resolver};
use mm_tests::versions::{
    commit_ts_of_row, node_with_schema, origins, utc as ts, write_under_origin,
};
use tokio_postgres::types::ToSql;

fn micros(t: DateTime<Utc>) -> i64 {
    // PostgreSQL's epoch: 2000-01-01 UTC.
    (t - ts("2000-01-01T00:00:00Z"))
        .num_microseconds()
        .unwrap_or_default()
}

const LOCAL: &str = "m";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_and_rust_last_writer_wins_agree() -> Result<()> {
    mm_tests::init_tracing();
    let (pg, c) = node_with_schema("ipr").await?;
    c.batch_execute(
        "CREATE TABLE t (id int PRIMARY KEY, v text);
         SELECT pg_replication_origin_create('mm_a');
         SELECT pg_replication_origin_create('mm_b');
         SELECT pg_replication_origin_create('mm_zz');",
    )
    .await?;
    // Row 1: a local write; rows 2-4 under origins a, b and zz, 2 and 3 with
    // the same commit timestamp (the node name decides between them).
    c.batch_execute("INSERT INTO t VALUES (1, 'local')").await?;
    let at = "2026-01-01 00:00:10+00";
    for (id, origin, at) in [
        (2, "mm_a", at),
        (3, "mm_b", at),
        (4, "mm_zz", "2026-01-01 00:00:20+00"),
    ] {
        let sql = format!("INSERT INTO t VALUES ({id}, '{origin}')");
        write_under_origin(&pg, origin, at, &sql).await?;
    }
    let origins = origins(&c).await?;
    let oid_of = |n: &str| -> u32 {
        // A publisher this node has no origin for: an id no version has.
        origins
            .iter()
            .find(|(_, name)| name == n)
            .map_or(65_000, |(id, _)| *id)
    };
    let name_of = |id: u32| -> String {
        if id == 0 {
            return LOCAL.to_owned();
        }
        origins
            .iter()
            .find(|(i, _)| *i == id)
            .map_or_else(|| format!("origin {id}"), |(_, n)| n.clone())
    };
    let ids: Vec<u32> = origins.iter().map(|(i, _)| *i).collect();
    let names: Vec<String> = origins.iter().map(|(_, n)| n.clone()).collect();
    let local_ts = commit_ts_of_row(&c, 1).await?;

    let text = fast_update_in_place(
        "\"public\".\"t\"",
        &["id", "v"],
        &["integer", "text"],
        &["id"],
        Commit::Later,
    );
    let stmt = c.prepare(&text).await.context("prepare")?;
    let times = [
        ts("2026-01-01T00:00:05Z"),
        ts("2026-01-01T00:00:10Z"),
        ts("2026-01-01T00:00:15Z"),
        ts("2026-01-01T00:00:20Z"),
        local_ts,
        local_ts + chrono::Duration::seconds(60),
    ];
    let (mut applied, mut kept, mut routine) = (0, 0, 0);
    for id in 1..=4i32 {
        let row = c
            .query_one(
                "SELECT o.roident::int8, o.\"timestamp\", to_jsonb(t.*) FROM t \
                 LEFT JOIN LATERAL pg_xact_commit_timestamp_origin(t.xmin) o ON true WHERE id = $1",
                &[&id],
            )
            .await?;
        let roident = row.get::<_, Option<i64>>(0).map(|v| v as u32);
        let local_commit: Option<DateTime<Utc>> = row.get(1);
        let local_row: serde_json::Value = row.get(2);
        let facts = VersionFacts {
            roident,
            ts: local_commit,
            this_txn: false,
        };
        for peer in ["a", "b", "zz", "c"] {
            for &remote in &times {
                let new_v = format!("from {peer}");
                let params = [
                    Param::text(id.to_string()),
                    Param::text(new_v.clone()),
                    Param::text(id.to_string()),
                    Param::oid_array(&[oid_of(peer)]),
                    Param::timestamptz(micros(remote)),
                    Param::oid_array(&[]),
                    Param::timestamptz_array(&[]),
                    Param::text("public.t"),
                    Param::text("0/ABC"),
                    Param::text(peer),
                    Param::text(LOCAL),
                    Param::oid_array(&ids),
                    Param::text_array(&names),
                ];
                let refs: Vec<&(dyn ToSql + Sync)> =
                    params.iter().map(|p| p as &(dyn ToSql + Sync)).collect();
                c.batch_execute("BEGIN").await?;
                let logged: i32 = c.query_one(&stmt, &refs).await?.get(0);
                let v: String = c
                    .query_one("SELECT v FROM t WHERE id = $1", &[&id])
                    .await?
                    .get(0);
                let log = c
                    .query_opt(
                        "SELECT conflict_type, key, local_origin, local_commit_ts, remote_origin, \
                         remote_commit_ts, remote_lsn::text, resolution, local_tuple, remote_tuple \
                         FROM mm.conflict_log",
                        &[],
                    )
                    .await?;
                c.batch_execute("ROLLBACK").await?;

                let case = format!(
                    "row {id} ({roident:?} at {local_commit:?}), change from {peer} at {remote}"
                );
                let no_resolver = no_resolver_needed(&facts, &[oid_of(peer)], |_| None, remote);
                if no_resolver {
                    ensure!(
                        logged == 0 && log.is_none(),
                        "{case}: logged a routine change"
                    );
                    ensure!(v == new_v, "{case}: routine change not applied");
                    routine += 1;
                    continue;
                }
                let conflict = Conflict {
                    kind: ConflictType::UpdateOriginDiffers,
                    relation: "public.t".into(),
                    local: Some(local_row.clone()),
                    remote_old: None,
                    remote_new: Some(serde_json::json!({"id": id, "v": new_v})),
                    local_origin: Some(name_of(roident.unwrap_or(0))),
                    local_commit_ts: local_commit,
                    remote_origin: peer.into(),
                    remote_commit_ts: remote,
                };
                let (want_v, label) = match LastWriterWins.resolve(&conflict) {
                    Resolution::ApplyRemote => (new_v.as_str(), "apply_remote"),
                    Resolution::KeepLocal => {
                        (local_row["v"].as_str().context("local v")?, "keep_local")
                    }
                    other => anyhow::bail!("{case}: LWW said {other:?}"),
                };
                if label == "apply_remote" {
                    applied += 1;
                } else {
                    kept += 1;
                }
                ensure!(logged == 1, "{case}: logged {logged} conflicts, want 1");
                ensure!(
                    v == want_v,
                    "{case}: row holds {v:?}, Rust resolver keeps {want_v:?}"
                );
                let log = log.with_context(|| format!("{case}: no conflict_log row"))?;
                let got = (
                    log.get::<_, String>(0),
                    log.get::<_, serde_json::Value>(1),
                    log.get::<_, Option<String>>(2),
                    log.get::<_, Option<DateTime<Utc>>>(3),
                    log.get::<_, String>(4),
                    log.get::<_, DateTime<Utc>>(5),
                    log.get::<_, String>(6),
                    log.get::<_, String>(7),
                    log.get::<_, serde_json::Value>(8),
                    log.get::<_, serde_json::Value>(9),
                );
                let want = (
                    "update_origin_differs".to_owned(),
                    serde_json::json!({ "id": id }),
                    conflict.local_origin.clone(),
                    conflict.local_commit_ts,
                    peer.to_owned(),
                    remote,
                    "0/ABC".to_owned(),
                    label.to_owned(),
                    local_row.clone(),
                    conflict.remote_new.clone().unwrap_or_default(),
                );
                ensure!(got == want, "{case}: logged {got:?}, want {want:?}");
            }
        }
    }
    ensure!(
        applied > 10 && kept > 10 && routine > 2,
        "the vectors exercise too little: {applied} applied, {kept} kept, {routine} routine"
    );
    Ok(())
}
