//! Partitioned tables: one relation identity, the partition root (the
//! publication publishes via the root), for row lookup, tombstones and
//! every conflict check, whichever partition holds a row; rows moving
//! between partitions arrive as updates.
//!
//! The divergence this pins down: a delete through the parent recorded its
//! tombstone under the parent while peers' changes arrived for the leaf, so
//! an older concurrent update resurrected the row on one node only.

use std::time::Duration;

use anyhow::{Result, ensure};
use mm_tests::TestCluster;

const SCHEMA: &str = "
CREATE TABLE pt (id int, region text, v text, PRIMARY KEY (id, region)) PARTITION BY LIST (region);
CREATE TABLE pt_eu PARTITION OF pt FOR VALUES IN ('eu');
CREATE TABLE pt_us PARTITION OF pt FOR VALUES IN ('us');";

const DUMP: &str = "SELECT tableoid::regclass::text, id, region, v FROM pt ORDER BY id";

fn rows(r: &[&[&str]]) -> Vec<Vec<Option<String>>> {
    r.iter()
        .map(|row| row.iter().map(|v| Some((*v).to_owned())).collect())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_tables_replicate_and_converge_under_conflicts() -> Result<()> {
    mm_tests::init_tracing();
    let c = TestCluster::start(&["pa1", "pa2"], SCHEMA).await?;
    c.pg[0]
        .execute(
            "INSERT INTO pt VALUES (1, 'eu', 'one'), (2, 'us', 'two'), (3, 'eu', 'three'), \
             (4, 'us', 'four'), (5, 'eu', 'five')",
        )
        .await?;
    c.wait_sync(60).await?;
    // A row moves between partitions (an update of the partition key).
    c.pg[1]
        .execute("UPDATE pt SET region = 'us', v = 'moved' WHERE id = 5")
        .await?;
    c.wait_sync(60).await?;
    let got = c.assert_same(DUMP).await?;
    ensure!(
        got == rows(&[
            &["pt_eu", "1", "eu", "one"],
            &["pt_us", "2", "us", "two"],
            &["pt_eu", "3", "eu", "three"],
            &["pt_us", "4", "us", "four"],
            &["pt_us", "5", "us", "moved"],
        ]),
        "{got:?}"
    );
    tokio::time::sleep(Duration::from_millis(2500)).await;

    // B updates rows 1 and 2; slightly later A deletes them, row 1 through
    // the parent and row 2 straight from its partition. The deletes are
    // newer: they win on both nodes, no resurrection. Row 3: A's later
    // update beats B's earlier delete through the parent.
    c.pause("pa1", "pa2").await?;
    c.pause("pa2", "pa1").await?;
    c.pg[1]
        .execute("UPDATE pt SET v = 'b' WHERE id IN (1, 2)")
        .await?;
    c.pg[1].execute("DELETE FROM pt WHERE id = 3").await?;
    tokio::time::sleep(Duration::from_millis(50)).await;
    c.pg[0].execute("DELETE FROM pt WHERE id = 1").await?;
    c.pg[0].execute("DELETE FROM pt_us WHERE id = 2").await?;
    c.pg[0]
        .execute("UPDATE pt SET v = 'a' WHERE id = 3")
        .await?;
    c.resume("pa1", "pa2").await?;
    c.resume("pa2", "pa1").await?;
    c.wait_sync(90).await?;
    let got = c.assert_same(DUMP).await?;
    ensure!(
        got == rows(&[
            &["pt_eu", "3", "eu", "a"],
            &["pt_us", "4", "us", "four"],
            &["pt_us", "5", "us", "moved"],
        ]),
        "after the conflicts: {got:?}"
    );
    // Tombstones are kept under the root on both nodes, never a partition.
    for i in 0..2 {
        let leafs = c
            .rows(
                i,
                "SELECT count(*) FROM mm.tombstones WHERE relid IN ('pt_eu'::regclass, 'pt_us'::regclass)",
            )
            .await?;
        ensure!(leafs == rows(&[&["0"]]), "{}: {leafs:?}", c.pg[i].name());
    }
    // A TRUNCATE of one partition replicates (PostgreSQL does not publish
    // it via the root; mm sends it itself), and one of the root too.
    c.pg[0].execute("TRUNCATE pt_us").await?;
    c.wait_sync(60).await?;
    let got = c.assert_same(DUMP).await?;
    ensure!(
        got == rows(&[&["pt_eu", "3", "eu", "a"]]),
        "after TRUNCATE pt_us: {got:?}"
    );
    c.pg[1]
        .execute("INSERT INTO pt VALUES (8, 'us', 'eight'); TRUNCATE pt; INSERT INTO pt VALUES (9, 'eu', 'nine')")
        .await?;
    c.wait_sync(60).await?;
    let got = c.assert_same(DUMP).await?;
    ensure!(
        got == rows(&[&["pt_eu", "9", "eu", "nine"]]),
        "after TRUNCATE pt: {got:?}"
    );
    // A's log: B's older updates of rows 1 and 2 met A's tombstones.
    let log = c
        .rows(
            0,
            "SELECT conflict_type, relation, key::text, resolution FROM mm.conflict_log ORDER BY key::text",
        )
        .await?;
    ensure!(
        log == rows(&[
            &[
                "update_deleted",
                "public.pt",
                r#"{"id": 1, "region": "eu"}"#,
                "keep_local"
            ],
            &[
                "update_deleted",
                "public.pt",
                r#"{"id": 2, "region": "us"}"#,
                "keep_local"
            ],
            &[
                "delete_origin_differs",
                "public.pt",
                r#"{"id": 3, "region": "eu"}"#,
                "keep_local"
            ],
        ]),
        "A's conflict log: {log:?}"
    );
    Ok(())
}
