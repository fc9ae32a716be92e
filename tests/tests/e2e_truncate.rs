//! TRUNCATE against concurrent changes: a truncate wins over every older
//! change to its table from any origin, on every node, and loses to newer
//! ones (per-table truncate versions, `mm.truncates`). Deterministic like
//! e2e_conflicts: streams paused, writes committed in a known order on each
//! side, streams resumed, exact rows on every node.

use std::time::Duration;

use anyhow::{Result, ensure};
use mm_tests::TestCluster;

const SCHEMA: &str = "CREATE TABLE t (id int PRIMARY KEY, v text);
CREATE TABLE nokey (a int, b text);
ALTER TABLE nokey REPLICA IDENTITY FULL;";

async fn pause_both(c: &TestCluster, a: &str, b: &str) -> Result<()> {
    c.pause(a, b).await?;
    c.pause(b, a).await
}

async fn resume_both(c: &TestCluster, a: &str, b: &str) -> Result<()> {
    c.resume(a, b).await?;
    c.resume(b, a).await?;
    c.wait_sync(90).await
}

async fn dump(c: &TestCluster, sql: &str) -> Result<Vec<Vec<Option<String>>>> {
    c.assert_same(sql).await
}

fn rows(r: &[&[&str]]) -> Vec<Vec<Option<String>>> {
    r.iter()
        .map(|row| row.iter().map(|v| Some((*v).to_owned())).collect())
        .collect()
}

/// B inserts (and updates a seeded row), slightly later A truncates: the
/// older insert and update must not survive on A, where they arrive after
/// the truncate; B applies the truncate. Both end empty, for a keyed table
/// and one without a key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncate_wins_over_older_changes() -> Result<()> {
    mm_tests::init_tracing();
    let c = TestCluster::start(&["tr1", "tr2"], SCHEMA).await?;
    c.pg[0]
        .execute(
            "INSERT INTO t VALUES (1, 'seed'), (2, 'seed'); INSERT INTO nokey VALUES (1, 'seed')",
        )
        .await?;
    c.wait_sync(60).await?;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    pause_both(&c, "tr1", "tr2").await?;
    c.pg[1].execute("INSERT INTO t VALUES (3, 'b')").await?;
    c.pg[1].execute("UPDATE t SET v = 'b' WHERE id = 2").await?;
    c.pg[1].execute("DELETE FROM t WHERE id = 1").await?;
    c.pg[1].execute("INSERT INTO nokey VALUES (2, 'b')").await?;
    tokio::time::sleep(Duration::from_millis(50)).await;
    c.pg[0].execute("TRUNCATE t, nokey").await?;
    resume_both(&c, "tr1", "tr2").await?;
    let t = dump(&c, "SELECT id, v FROM t ORDER BY id").await?;
    ensure!(t.is_empty(), "t after the truncate: {t:?}");
    let n = dump(&c, "SELECT a, b FROM nokey ORDER BY a").await?;
    ensure!(n.is_empty(), "nokey after the truncate: {n:?}");
    // On A the discarded changes are logged against the truncate's version.
    let log = c
        .rows(
            0,
            "SELECT conflict_type, relation, resolution, local_origin FROM mm.conflict_log \
             ORDER BY conflict_type, relation",
        )
        .await?;
    ensure!(
        log == rows(&[
            &["delete_missing", "public.t", "keep_local", "tr1"],
            &["insert_exists", "public.nokey", "keep_local", "tr1"],
            &["insert_exists", "public.t", "keep_local", "tr1"],
            &["update_deleted", "public.t", "keep_local", "tr1"],
        ]),
        "conflict log on tr1: {log:?}"
    );
    Ok(())
}

/// A truncates first; later, B inserts a row and updates one that A's
/// truncate removed: the newer changes win on both nodes (B keeps its newer
/// rows when A's older truncate arrives; A applies them after it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncate_loses_to_newer_changes() -> Result<()> {
    mm_tests::init_tracing();
    let c = TestCluster::start(&["tl1", "tl2"], SCHEMA).await?;
    c.pg[0]
        .execute("INSERT INTO t VALUES (1, 'seed'), (2, 'seed'), (3, 'seed'); INSERT INTO nokey VALUES (1, 'seed')")
        .await?;
    c.wait_sync(60).await?;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    pause_both(&c, "tl1", "tl2").await?;
    c.pg[0].execute("TRUNCATE t, nokey").await?;
    tokio::time::sleep(Duration::from_millis(50)).await;
    c.pg[1].execute("INSERT INTO t VALUES (10, 'b')").await?;
    c.pg[1]
        .execute("UPDATE t SET v = 'b newer' WHERE id = 2")
        .await?;
    c.pg[1].execute("INSERT INTO nokey VALUES (2, 'b')").await?;
    resume_both(&c, "tl1", "tl2").await?;
    let t = dump(&c, "SELECT id, v FROM t ORDER BY id").await?;
    ensure!(t == rows(&[&["2", "b newer"], &["10", "b"]]), "t: {t:?}");
    let n = dump(&c, "SELECT a, b FROM nokey ORDER BY a").await?;
    ensure!(n == rows(&[&["2", "b"]]), "nokey: {n:?}");

    // A later truncate with nothing newer anywhere is a plain TRUNCATE
    // everywhere, RESTART IDENTITY included.
    c.pg[1].execute("TRUNCATE t").await?;
    c.wait_sync(60).await?;
    let t = dump(&c, "SELECT count(*) FROM t").await?;
    ensure!(t == rows(&[&["0"]]), "t after a later truncate: {t:?}");
    Ok(())
}
