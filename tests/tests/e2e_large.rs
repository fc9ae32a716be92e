//! A 1M-row transaction: streamed to the subscriber's agent while the
//! publisher's transaction is still open, applied with bounded memory.

use std::time::{Duration, Instant};

use anyhow::Result;
use mm_tests::{PgOptions, TestCluster};

const SCHEMA: &str = "CREATE TABLE big (id int PRIMARY KEY, payload text);";
/// The subscriber agent's peak RSS must stay under this, whatever the
/// transaction size (the 1M rows are ~60 MB of changes).
const RSS_CEILING: u64 = 160 * 1024 * 1024;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn million_row_transaction_streams_with_bounded_memory() -> Result<()> {
    mm_tests::init_tracing();
    // A small decoding memory limit makes the publisher stream early.
    let opts = PgOptions::default().conf("logical_decoding_work_mem", "1MB");
    let mut c = TestCluster::start_with(&["l1", "l2"], SCHEMA, opts).await?;
    let client = c.pg[0].connect().await?;
    client
        .batch_execute(
            "BEGIN; INSERT INTO big SELECT g, md5(g::text) FROM generate_series(1, 1000000) g;",
        )
        .await?;
    // Still uncommitted on l1, yet l2's agent has been receiving it.
    let deadline = Instant::now() + Duration::from_secs(120);
    let streamed = loop {
        let s = c.stream_status("l1", "l2").await?;
        let b = s
            .get("streamed_bytes")
            .and_then(|v| v.as_u64())
            .unwrap_or(0);
        if b > 20 * 1024 * 1024 {
            break b;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "no streamed bytes before commit: {s}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(
        c.rows(1, "SELECT count(*) FROM big").await?[0][0].as_deref(),
        Some("0")
    );
    // Crash the subscriber's agent with part of the transaction spooled: the
    // spool is discarded and the publisher must stream it all again.
    c.agents[1].kill9()?;
    c.agents[1].start()?;
    c.agents[1].wait_ready(Duration::from_secs(30)).await?;
    client
        .batch_execute(
            "INSERT INTO big SELECT g, md5(g::text) FROM generate_series(1000001, 1000100) g",
        )
        .await?;
    let committed = Instant::now();
    client.batch_execute("COMMIT").await?;
    c.wait_for(
        1,
        "SELECT count(*) FROM big",
        "1000100",
        Duration::from_secs(300),
    )
    .await?;
    let visible_after = committed.elapsed();
    let peak = c.agents[1].peak_rss_bytes().unwrap_or(0);
    eprintln!(
        "streamed before commit: {} MiB; commit-to-visible on l2: {:.1}s; l2 agent peak RSS: {} MiB",
        streamed >> 20,
        visible_after.as_secs_f64(),
        peak >> 20
    );
    assert!(
        peak > 0 && peak < RSS_CEILING,
        "peak RSS {} MiB",
        peak >> 20
    );
    c.wait_sync(120).await?;
    c.assert_same("SELECT count(*), sum(id), md5(string_agg(payload, '' ORDER BY id)) FROM big")
        .await?;
    Ok(())
}

/// A transaction the publisher does not stream (it fits its
/// `logical_decoding_work_mem`) arrives whole after its commit. The agent
/// keeps a transaction until it commits locally (a conflict applies it a
/// second time, carefully), and used to keep this one in memory whole:
/// 600k rows took ~250 MiB in a debug build (200k: 487 MB in the release
/// benchmark). Beyond 1 MiB of messages it now goes to the spool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_transaction_sent_after_commit_is_applied_with_bounded_memory() -> Result<()> {
    mm_tests::init_tracing();
    let opts = PgOptions::default().conf("logical_decoding_work_mem", "1GB");
    let c = TestCluster::start_with(&["nl1", "nl2"], SCHEMA, opts).await?;
    c.pg[0]
        .execute("INSERT INTO big SELECT g, md5(g::text) FROM generate_series(1, 600000) g")
        .await?;
    c.wait_for(
        1,
        "SELECT count(*) FROM big",
        "600000",
        Duration::from_secs(300),
    )
    .await?;
    let s = c.stream_status("nl1", "nl2").await?;
    let streamed = s
        .get("streamed_bytes")
        .and_then(|v| v.as_u64())
        .unwrap_or(0);
    anyhow::ensure!(streamed == 0, "the publisher streamed it after all: {s}");
    // Applied while it arrived (apply/early.rs), not only after its COMMIT.
    let early = s.get("early_txns").and_then(|v| v.as_u64()).unwrap_or(0);
    anyhow::ensure!(early == 1, "not applied while it arrived: {s}");
    let peak = c.agents[1].peak_rss_bytes().unwrap_or(0);
    eprintln!("nl2 agent peak RSS: {} MiB", peak >> 20);
    const CEILING: u64 = 100 * 1024 * 1024;
    anyhow::ensure!(
        peak > 0 && peak < CEILING,
        "peak RSS {} MiB for a 600k-row transaction",
        peak >> 20
    );
    c.wait_sync(120).await?;
    c.assert_same("SELECT count(*), sum(id), md5(string_agg(payload, '' ORDER BY id)) FROM big")
        .await?;
    Ok(())
}

/// A large transaction applied while it arrives meets a key the
/// subscriber wrote later (a conflict in its middle): its early part rolls
/// back and it is applied whole at its COMMIT, with the resolver. Both
/// nodes keep the newer row (last writer wins), every other row arrives
/// once, and the conflict is logged where it was met.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflict_inside_a_transaction_applied_while_it_arrives_is_resolved() -> Result<()> {
    mm_tests::init_tracing();
    let opts = PgOptions::default().conf("logical_decoding_work_mem", "1GB");
    let c = TestCluster::start_with(&["el1", "el2"], SCHEMA, opts).await?;
    c.pause("el1", "el2").await?;
    c.pg[0]
        .execute("INSERT INTO big SELECT g, md5(g::text) FROM generate_series(1, 20000) g")
        .await?;
    // Newer than the 20k-row transaction: it wins on both nodes.
    c.pg[1]
        .execute("INSERT INTO big VALUES (15000, 'written on el2 later')")
        .await?;
    c.resume("el1", "el2").await?;
    c.wait_sync(180).await?;
    c.assert_same("SELECT count(*), sum(id), md5(string_agg(payload, '' ORDER BY id)) FROM big")
        .await?;
    for i in 0..2 {
        let got = c.pg[i]
            .query_one_string("SELECT payload FROM big WHERE id = 15000")
            .await?;
        anyhow::ensure!(
            got.as_deref() == Some("written on el2 later"),
            "node {i}: row 15000 is {got:?}"
        );
        let n = c.pg[i].query_one_string("SELECT count(*) FROM big").await?;
        anyhow::ensure!(n.as_deref() == Some("20000"), "node {i}: {n:?} rows");
    }
    let logged = c.pg[1]
        .query_one_string(
            "SELECT count(*) FROM mm.conflict_log WHERE conflict_type = 'insert_exists' AND key = '{\"id\": 15000}'",
        )
        .await?;
    anyhow::ensure!(
        logged.as_deref() == Some("1"),
        "el2's conflict log: {logged:?}"
    );
    Ok(())
}
