//! The routine test exists twice: `mm.routine` (installed SQL, run inside
//! every fast-path UPDATE/DELETE) and `conflict::routine::no_resolver_needed`
//! (the careful path). Both must say the same for every row version and
//! every publisher / watermark / timestamp: this runs them on the same
//! vectors, rows written on real PostgreSQL under different replication
//! origins with chosen commit timestamps.

use anyhow::{Context, Result, ensure};
use chrono::{DateTime, Utc};
use mm_agent::conflict::routine::{VersionFacts, no_resolver_needed};
use mm_tests::versions::{commit_ts_of_row, node_with_schema, utc as ts, write_under_origin};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_and_rust_routine_tests_agree() -> Result<()> {
    mm_tests::init_tracing();
    let (pg, c) = node_with_schema("rr").await?;
    c.batch_execute(
        "CREATE TABLE t (id int PRIMARY KEY);
         SELECT pg_replication_origin_create('mm_a');
         SELECT pg_replication_origin_create('mm_b');",
    )
    .await?;
    // Row 1: a local write; rows 2 and 3 under origins a and b with chosen
    // commit timestamps (as an apply session writes them).
    c.batch_execute("INSERT INTO t VALUES (1)").await?;
    for (id, origin, at) in [
        (2, "mm_a", "2026-01-01 00:00:10+00"),
        (3, "mm_b", "2026-01-01 00:00:20+00"),
    ] {
        write_under_origin(&pg, origin, at, &format!("INSERT INTO t VALUES ({id})")).await?;
    }
    let ids = c
        .query(
            "SELECT roname, roident::int8 FROM pg_replication_origin WHERE roname IN ('mm_a', 'mm_b') ORDER BY 1",
            &[],
        )
        .await?;
    let id_of = |n: &str| -> Result<u32> {
        let r = ids
            .iter()
            .find(|r| r.get::<_, String>(0) == n)
            .with_context(|| format!("origin {n}"))?;
        Ok(r.get::<_, i64>(1) as u32)
    };
    let (a, b) = (id_of("mm_a")?, id_of("mm_b")?);
    let local_ts = commit_ts_of_row(&c, 1).await?;

    let times = [
        ts("2026-01-01T00:00:05Z"),
        ts("2026-01-01T00:00:10Z"),
        ts("2026-01-01T00:00:15Z"),
        ts("2026-01-01T00:00:20Z"),
        ts("2026-01-01T00:00:25Z"),
        local_ts,
        local_ts + chrono::Duration::seconds(60),
    ];
    // Watermarks: (origin id, timestamp) pairs the publisher announced.
    let mut watermarks: Vec<Vec<(u32, DateTime<Utc>)>> = vec![vec![]];
    for &o in &[0, a, b] {
        for &t in &times {
            watermarks.push(vec![(o, t)]);
        }
    }
    watermarks.push(vec![(a, times[2]), (b, times[4]), (0, times[6])]);
    watermarks.push(vec![(a, times[0]), (b, times[3])]);

    let (mut trues, mut falses, mut cases) = (0, 0, 0);
    for id in 1..=3 {
        let row = c
            .query_one(
                "SELECT (o).roident::int8, (o).\"timestamp\" FROM (SELECT pg_xact_commit_timestamp_origin(xmin) o FROM t WHERE id = $1) x",
                &[&id],
            )
            .await?;
        let facts = VersionFacts {
            roident: row.get::<_, Option<i64>>(0).map(|v| v as u32),
            ts: row.get(1),
            this_txn: false,
        };
        for &peer in &[a, b] {
            for &remote in &times {
                for wm in &watermarks {
                    let wm_ids: Vec<u32> = wm.iter().map(|(o, _)| *o).collect();
                    let wm_ts: Vec<DateTime<Utc>> = wm.iter().map(|(_, t)| *t).collect();
                    // The publisher's origins: one per apply lane.
                    let peers = vec![peer];
                    let sql: bool = c
                        .query_one(
                            "SELECT mm.routine(xmin, $1::oid[], $2::timestamptz, $3::oid[], $4::timestamptz[]) FROM t WHERE id = $5",
                            &[&peers, &remote, &wm_ids, &wm_ts, &id],
                        )
                        .await?
                        .get(0);
                    let rust = no_resolver_needed(
                        &facts,
                        &peers,
                        |o| wm.iter().find(|(x, _)| *x == o).map(|(_, t)| *t),
                        remote,
                    );
                    ensure!(
                        sql == rust,
                        "row {id} {facts:?}, publisher {peer}, change at {remote}, watermark {wm:?}: SQL says {sql}, Rust {rust}"
                    );
                    cases += 1;
                    if sql {
                        trues += 1;
                    } else {
                        falses += 1;
                    }
                }
            }
        }
    }
    ensure!(
        trues > 20 && falses > 20,
        "the vectors exercise too little: {trues} true, {falses} false of {cases}"
    );
    Ok(())
}
