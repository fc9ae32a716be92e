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
    conflict_inside_an_early_transaction("1GB", ["el1", "el2"], false).await
}

/// The same with a transaction the publisher streams before its commit:
/// applied from its first segment with its commit timestamp not known
/// yet, it is rolled back at the conflict and applied from the spool at
/// its STREAM COMMIT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflict_inside_a_streamed_transaction_applied_while_it_arrives_is_resolved()
-> Result<()> {
    conflict_inside_an_early_transaction("1MB", ["es1", "es2"], true).await
}

async fn conflict_inside_an_early_transaction(
    work_mem: &str,
    names: [&str; 2],
    streamed: bool,
) -> Result<()> {
    mm_tests::init_tracing();
    let opts = PgOptions::default().conf("logical_decoding_work_mem", work_mem);
    let c = TestCluster::start_with(&names, SCHEMA, opts).await?;
    c.pause(names[0], names[1]).await?;
    c.pg[0]
        .execute("INSERT INTO big SELECT g, md5(g::text) FROM generate_series(1, 20000) g")
        .await?;
    // Newer than the 20k-row transaction: it wins on both nodes.
    c.pg[1]
        .execute("INSERT INTO big VALUES (15000, 'written on the subscriber later')")
        .await?;
    c.resume(names[0], names[1]).await?;
    c.wait_sync(180).await?;
    c.assert_same("SELECT count(*), sum(id), md5(string_agg(payload, '' ORDER BY id)) FROM big")
        .await?;
    for i in 0..2 {
        let got = c.pg[i]
            .query_one_string("SELECT payload FROM big WHERE id = 15000")
            .await?;
        anyhow::ensure!(
            got.as_deref() == Some("written on the subscriber later"),
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
        "the subscriber's conflict log: {logged:?}"
    );
    let s = c.stream_status(names[0], names[1]).await?;
    let sent = s
        .get("streamed_bytes")
        .and_then(|v| v.as_u64())
        .unwrap_or(0);
    anyhow::ensure!((sent > 0) == streamed, "streamed or not as configured: {s}");
    Ok(())
}

/// Transactions the publisher streams before their commit are applied
/// from their first segment, not after the commit (a 1M-row one took
/// twice native's time): a plain one, one with a released savepoint, then
/// one with a subtransaction rolled back after it was streamed (what was
/// applied of it must go: it is given up and applied from the spool) and
/// one interleaved with transactions that commit while it runs (they must
/// commit here first: it is given up as well). Every row arrives exactly
/// once, in the same state on both nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_transactions_are_applied_while_they_arrive() -> Result<()> {
    mm_tests::init_tracing();
    let opts = PgOptions::default().conf("logical_decoding_work_mem", "1MB");
    let c = TestCluster::start_with(&["sa1", "sa2"], SCHEMA, opts).await?;
    let early = |s: &serde_json::Value| s.get("early_txns").and_then(|v| v.as_u64()).unwrap_or(0);
    c.pause("sa1", "sa2").await?;
    c.pg[0]
        .execute(
            "BEGIN; INSERT INTO big SELECT g, md5(g::text) FROM generate_series(1, 60000) g; \
             SAVEPOINT a; INSERT INTO big SELECT g, 'released' FROM generate_series(60001, 70000) g; RELEASE a; \
             INSERT INTO big SELECT g, md5(g::text) FROM generate_series(70001, 100000) g; COMMIT",
        )
        .await?;
    c.resume("sa1", "sa2").await?;
    c.wait_sync(180).await?;
    let s = c.stream_status("sa1", "sa2").await?;
    anyhow::ensure!(early(&s) == 1, "not applied while it arrived: {s}");
    c.assert_same("SELECT count(*), sum(id), md5(string_agg(payload, '' ORDER BY id)) FROM big")
        .await?;

    c.pause("sa1", "sa2").await?;
    c.pg[0]
        .execute(
            "BEGIN; INSERT INTO big SELECT g, md5(g::text) FROM generate_series(100001, 150000) g; \
             SAVEPOINT b; INSERT INTO big SELECT g, 'rolled back' FROM generate_series(150001, 170000) g; ROLLBACK TO b; \
             INSERT INTO big SELECT g, md5(g::text) FROM generate_series(170001, 180000) g; COMMIT",
        )
        .await?;
    let a = c.pg[0].connect().await?;
    a.batch_execute(
        "BEGIN; INSERT INTO big SELECT g, md5(g::text) FROM generate_series(200001, 250000) g",
    )
    .await?;
    for i in 0..5 {
        c.pg[0]
            .execute(&format!(
                "INSERT INTO big VALUES ({}, 'committed meanwhile')",
                300001 + i
            ))
            .await?;
    }
    a.batch_execute(
        "INSERT INTO big SELECT g, md5(g::text) FROM generate_series(250001, 300000) g; COMMIT",
    )
    .await?;
    c.resume("sa1", "sa2").await?;
    c.wait_sync(180).await?;
    c.assert_same("SELECT count(*), sum(id), md5(string_agg(payload, '' ORDER BY id)) FROM big")
        .await?;
    for i in 0..2 {
        let n = c.pg[i]
            .query_one_string(
                "SELECT count(*) || ' ' || count(*) FILTER (WHERE payload = 'rolled back') FROM big",
            )
            .await?;
        anyhow::ensure!(n.as_deref() == Some("260005 0"), "node {i}: {n:?}");
    }
    let s = c.stream_status("sa1", "sa2").await?;
    anyhow::ensure!(
        early(&s) == 1,
        "given up for the rolled-back subtransaction and the interleaving: {s}"
    );
    Ok(())
}

/// A streamed transaction's commit timestamp is not known while it arrives,
/// so a truncate of its table stops it being applied then, unless the
/// truncate is its publisher's own: that one committed there before any
/// change of the transaction to the table (the TRUNCATE's lock), so it is
/// older whatever the timestamp (`mm.insert_recheck`). Loading a table its
/// node truncated first (a staging table) is then applied while it
/// arrives; after a truncate from another node it is applied at its
/// commit. Both end identical on both nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_transaction_into_a_table_its_publisher_truncated_is_applied_while_it_arrives()
-> Result<()> {
    mm_tests::init_tracing();
    let opts = PgOptions::default().conf("logical_decoding_work_mem", "1MB");
    let c = TestCluster::start_with(&["st1", "st2"], SCHEMA, opts).await?;
    let early = |s: &serde_json::Value| s.get("early_txns").and_then(|v| v.as_u64()).unwrap_or(0);
    let load = |from: u32| {
        format!(
            "INSERT INTO big SELECT g, md5(g::text) FROM generate_series({from}, {}) g",
            from + 59_999
        )
    };
    // Truncated on st2: newer than anything st1 sent, older than what it
    // sends next, which only its commit timestamp can tell.
    c.pg[0].execute(&load(1)).await?;
    c.wait_sync(120).await?;
    c.pg[1].execute("TRUNCATE big").await?;
    c.wait_sync(120).await?;
    let before = early(&c.stream_status("st1", "st2").await?);
    c.pause("st1", "st2").await?;
    c.pg[0].execute(&load(100_001)).await?;
    c.resume("st1", "st2").await?;
    c.wait_sync(180).await?;
    let s = c.stream_status("st1", "st2").await?;
    anyhow::ensure!(
        early(&s) == before,
        "applied while it arrived past another node's truncate: {s}"
    );
    c.assert_same("SELECT count(*), sum(id), md5(string_agg(payload, '' ORDER BY id)) FROM big")
        .await?;

    // Truncated on st1, the publisher: its next load goes in as it arrives.
    c.pg[0].execute("TRUNCATE big").await?;
    c.wait_sync(120).await?;
    c.pause("st1", "st2").await?;
    c.pg[0].execute(&load(200_001)).await?;
    c.resume("st1", "st2").await?;
    c.wait_sync(180).await?;
    let s = c.stream_status("st1", "st2").await?;
    anyhow::ensure!(early(&s) == before + 1, "not applied while it arrived: {s}");
    c.assert_same("SELECT count(*), sum(id), md5(string_agg(payload, '' ORDER BY id)) FROM big")
        .await?;
    let n = c.pg[1]
        .query_one_string("SELECT count(*) || ' ' || min(id) FROM big")
        .await?;
    anyhow::ensure!(n.as_deref() == Some("60000 200001"), "st2: {n:?}");
    Ok(())
}

/// A large transaction in conflict on every row: the careful path logs
/// each conflict (both tuples as JSON) and used to hold every log row and
/// every deferred write's unread reply until the COMMIT, ~3.5 KB of agent
/// memory per row. It now writes and reads them every few hundred rows;
/// every conflict is still logged once, and the nodes agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_transaction_in_conflict_on_every_row_keeps_memory_bounded() -> Result<()> {
    mm_tests::init_tracing();
    const ROWS: u64 = 60_000;
    let c = TestCluster::start(&["cm1", "cm2"], SCHEMA).await?;
    c.pause("cm1", "cm2").await?;
    c.pause("cm2", "cm1").await?;
    let load = |what: &str| {
        format!("INSERT INTO big SELECT g, '{what}' || g FROM generate_series(1, {ROWS}) g")
    };
    c.pg[0].execute(&load("first ")).await?;
    // Later: wins on both nodes.
    c.pg[1].execute(&load("second ")).await?;
    let before = c.agents[1].peak_rss_bytes().unwrap_or(0);
    c.resume("cm1", "cm2").await?;
    c.resume("cm2", "cm1").await?;
    c.wait_sync(300).await?;
    let peak = c.agents[1].peak_rss_bytes().unwrap_or(0);
    eprintln!(
        "cm2 agent peak RSS before {} MiB, after {} MiB",
        before >> 20,
        peak >> 20
    );
    c.assert_same("SELECT count(*), sum(id), md5(string_agg(payload, '' ORDER BY id)) FROM big")
        .await?;
    let n = c.pg[0]
        .query_one_string("SELECT count(*) FILTER (WHERE payload LIKE 'second %') FROM big")
        .await?;
    anyhow::ensure!(n == Some(ROWS.to_string()), "cm1: {n:?}");
    for i in 0..2 {
        let logged = c.pg[i]
            .query_one_string("SELECT count(*) FROM mm.conflict_log")
            .await?;
        anyhow::ensure!(
            logged == Some(ROWS.to_string()),
            "node {i} logged {logged:?}"
        );
    }
    anyhow::ensure!(
        peak > 0 && peak.saturating_sub(before) < CONFLICT_RSS_GROWTH,
        "cm2 agent grew from {} MiB to {} MiB applying {ROWS} conflicting rows",
        before >> 20,
        peak >> 20
    );
    Ok(())
}

/// What applying 60k rows in conflict may add to an agent's peak RSS
/// (debug build): the rows themselves go to the spool; holding every
/// deferred write's reply and conflict-log row until COMMIT took ~210 MiB.
const CONFLICT_RSS_GROWTH: u64 = 48 * 1024 * 1024;

fn lsn(s: &str) -> Result<u64> {
    let (hi, lo) = s
        .split_once('/')
        .ok_or_else(|| anyhow::anyhow!("not an LSN: {s}"))?;
    Ok((u64::from_str_radix(hi, 16)? << 32) | u64::from_str_radix(lo, 16)?)
}

/// A streamed transaction that cannot be applied here (a value the local
/// column type refuses, in its middle) fails while it is applied before its
/// commit, when its commit LSN is not known yet. The stream must still stop
/// naming the real one (what `mmctl skip` takes), and apply the whole
/// transaction once the table is fixed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_transaction_that_fails_names_its_commit_lsn() -> Result<()> {
    streamed_failure_names_its_commit("sf", Bad::InTheMiddle).await
}

/// The same with the refused row's statement waiting (a lock held here)
/// until the transaction's COMMIT arrived and the rest of it was queued
/// behind it (`commit_early`): its failure is read only then, under the
/// stand-in identity of a streamed transaction whose commit is not known.
/// That must not be taken for the failure of a part still open (rolled
/// back and forgotten): the stream then reported the statement behind it
/// ("current transaction is aborted", 25P02) instead of the row and type
/// that failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_transaction_failing_after_its_commit_arrived_names_the_cause() -> Result<()> {
    streamed_failure_names_its_commit("sw", Bad::Waits).await
}

#[derive(Clone, Copy, PartialEq)]
enum Bad {
    InTheMiddle,
    /// In the middle, waiting for a lock until the COMMIT arrived.
    Waits,
}

async fn streamed_failure_names_its_commit(prefix: &str, bad: Bad) -> Result<()> {
    mm_tests::init_tracing();
    let opts = PgOptions::default().conf("logical_decoding_work_mem", "1MB");
    let (a, b) = (format!("{prefix}1"), format!("{prefix}2"));
    let c = TestCluster::start_with(&[a.as_str(), b.as_str()], SCHEMA, opts).await?;
    c.pg[0]
        .execute("CREATE TABLE typed (id int PRIMARY KEY, d text)")
        .await?;
    c.pg[1]
        .execute("CREATE TABLE typed (id int PRIMARY KEY, d date)")
        .await?;
    // Applied once already: the apply session has its statements for
    // the table, so the refused row is only bound and executed.
    c.pg[0]
        .execute("INSERT INTO typed VALUES (0, '2026-01-01')")
        .await?;
    c.wait_for(
        1,
        "SELECT count(*) FROM typed",
        "1",
        Duration::from_secs(30),
    )
    .await?;
    c.pause(&a, &b).await?;
    let wal = "SELECT pg_current_wal_lsn()::text";
    let before = c.pg[0].query_one_string(wal).await?.unwrap_or_default();
    let txn = match bad {
        Bad::InTheMiddle => {
            "BEGIN; INSERT INTO big SELECT g, md5(g::text) FROM generate_series(1, 60000) g; \
             INSERT INTO typed VALUES (1, 'not a date'); \
             INSERT INTO big SELECT g, md5(g::text) FROM generate_series(60001, 80000) g; COMMIT"
        }
        // After it, fewer rows than the pipeline keeps in flight (so the
        // stream receives the COMMIT while the refused row waits), large
        // enough that the publisher streams the refused row before its
        // commit (several segments of `logical_decoding_work_mem`).
        Bad::Waits => {
            "BEGIN; INSERT INTO big SELECT g, md5(g::text) FROM generate_series(1, 77000) g; \
             INSERT INTO typed VALUES (1, 'not a date'); \
             INSERT INTO big SELECT g, repeat(md5(g::text), 45) \
               FROM generate_series(77001, 80000) g; COMMIT"
        }
    };
    c.pg[0].execute(txn).await?;
    let after = c.pg[0].query_one_string(wal).await?.unwrap_or_default();
    // The refused row waits here for a lock until the COMMIT arrived and
    // was queued behind it: its failure is read only then.
    let holder = c.pg[1].connect().await?;
    if bad == Bad::Waits {
        holder
            .batch_execute("BEGIN; LOCK TABLE typed IN SHARE MODE")
            .await?;
    }
    c.resume(&a, &b).await?;
    if bad == Bad::Waits {
        c.pg[1]
            .wait_for_agent_lock_wait(Duration::from_secs(60), "the refused row")
            .await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        holder.batch_execute("COMMIT").await?;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let (stuck, s) = loop {
        let s = c.stream_status(&a, &b).await?;
        if let Some(l) = s.get("stuck_lsn").and_then(|v| v.as_str()) {
            break (l.to_owned(), s);
        }
        anyhow::ensure!(Instant::now() < deadline, "never stopped: {s}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    anyhow::ensure!(
        lsn(&before)? < lsn(&stuck)? && lsn(&stuck)? <= lsn(&after)?,
        "stuck at {stuck}, not at the transaction's commit (between {before} and {after}): {s}"
    );
    let err = s
        .get("last_error")
        .map(|e| e.to_string())
        .unwrap_or_default();
    anyhow::ensure!(
        err.contains("typed") && err.contains("type date") && !err.contains("25P02"),
        "the error does not name the table and the refused value: {s}"
    );
    // Every attempt, not only the last one status shows, met the cause.
    let log = std::fs::read_to_string(c.agents[1].log_path())?;
    let aborted = log
        .lines()
        .filter(|l| l.contains("25P02") || l.contains("earlier statement of its batch failed"))
        .collect::<Vec<_>>();
    anyhow::ensure!(
        aborted.is_empty(),
        "an attempt reported the statement behind the failed one: {aborted:?}"
    );
    assert_eq!(
        c.rows(1, "SELECT count(*) FROM big").await?[0][0].as_deref(),
        Some("0")
    );
    c.pg[1]
        .execute("ALTER TABLE typed ALTER COLUMN d TYPE text")
        .await?;
    // The stream retries the same transaction (backoff), now applicable.
    c.wait_for(
        1,
        "SELECT count(*) FROM big",
        "80000",
        Duration::from_secs(120),
    )
    .await?;
    c.wait_sync(120).await?;
    c.assert_same("SELECT count(*), sum(id), md5(string_agg(payload, '' ORDER BY id)) FROM big")
        .await?;
    c.assert_same("SELECT * FROM typed").await?;
    let n = c.pg[1].query_one_string("SELECT count(*) FROM big").await?;
    anyhow::ensure!(n.as_deref() == Some("80000"), "{n:?}");
    Ok(())
}

/// A streamed transaction applied while it arrives holds a local
/// transaction open, with its rows' locks and the node's apply gate. When
/// its publisher stops sending (here: the transaction stays open there),
/// it must not hold them for as long: after 2 s of silence it is rolled
/// back here, and applied from the spool at its commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_transaction_whose_publisher_falls_silent_is_rolled_back_here() -> Result<()> {
    mm_tests::init_tracing();
    let opts = PgOptions::default().conf("logical_decoding_work_mem", "1MB");
    let c = TestCluster::start_with(&["si1", "si2"], SCHEMA, opts).await?;
    // The apply session's transaction, whether it runs a statement or waits.
    let open_here = "SELECT count(*) FROM pg_stat_activity \
                     WHERE application_name = 'mm-agent' AND backend_xid IS NOT NULL";
    let client = c.pg[0].connect().await?;
    client
        .batch_execute(
            "BEGIN; INSERT INTO big SELECT g, md5(g::text) FROM generate_series(1, 100000) g",
        )
        .await?;
    // Applied while it arrives: an open local transaction with rows in it.
    let deadline = Instant::now() + Duration::from_secs(60);
    while c.pg[1].query_one_string(open_here).await?.as_deref() != Some("1") {
        anyhow::ensure!(
            Instant::now() < deadline,
            "never applied while it arrived: {}",
            c.stream_status("si1", "si2").await?
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Silence: rolled back after 2 s (and seen gone for a whole second).
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut gone = 0;
    while gone < 5 {
        gone = match c.pg[1].query_one_string(open_here).await?.as_deref() {
            Some("0") => gone + 1,
            _ => 0,
        };
        anyhow::ensure!(
            Instant::now() < deadline,
            "still open on si2 with its publisher silent: {}",
            c.stream_status("si1", "si2").await?
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    client
        .batch_execute(
            "INSERT INTO big SELECT g, md5(g::text) FROM generate_series(100001, 100100) g; COMMIT",
        )
        .await?;
    c.wait_sync(120).await?;
    c.assert_same("SELECT count(*), sum(id), md5(string_agg(payload, '' ORDER BY id)) FROM big")
        .await?;
    let s = c.stream_status("si1", "si2").await?;
    anyhow::ensure!(
        s.get("early_txns").and_then(|v| v.as_u64()) == Some(0),
        "committed from the early part after all: {s}"
    );
    let n = c.pg[1].query_one_string("SELECT count(*) FROM big").await?;
    anyhow::ensure!(n.as_deref() == Some("100100"), "{n:?}");
    Ok(())
}
