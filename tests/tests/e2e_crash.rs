//! Exactly-once across crashes: kill -9 agents and crash PostgreSQL nodes in
//! the middle of streams; afterwards every transaction is there exactly once.

use std::time::Duration;

use anyhow::Result;
use mm_tests::TestCluster;

// No primary key: a transaction applied twice would show as duplicate rows.
const SCHEMA: &str = "
CREATE TABLE events (origin text NOT NULL, seq int NOT NULL, payload text);
ALTER TABLE events REPLICA IDENTITY FULL;
";

/// (count, distinct seq) of `origin`'s events on node `i`.
async fn counts(c: &TestCluster, i: usize, origin: &str) -> Result<(i64, i64)> {
    let r = c
        .rows(
            i,
            &format!("SELECT count(*), count(DISTINCT seq) FROM events WHERE origin = '{origin}'"),
        )
        .await?;
    let n = |k: usize| {
        r[0][k]
            .as_deref()
            .unwrap_or("0")
            .parse::<i64>()
            .unwrap_or(-1)
    };
    Ok((n(0), n(1)))
}

/// Commits `n` single-row transactions on node `i`, one after another.
fn small_writer(
    c: &TestCluster,
    i: usize,
    origin: &'static str,
    n: i32,
) -> tokio::task::JoinHandle<Result<()>> {
    let dsn = c.pg[i].dsn();
    tokio::spawn(async move {
        let (client, conn) = tokio_postgres::connect(&dsn, tokio_postgres::NoTls).await?;
        tokio::spawn(conn);
        for k in 0..n {
            client
                .execute(
                    "INSERT INTO events VALUES ($1, $2, 'small')",
                    &[&origin, &k],
                )
                .await?;
        }
        Ok(())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_agent_during_many_small_and_one_large_transaction() -> Result<()> {
    mm_tests::init_tracing();
    let mut c = TestCluster::start(&["k1", "k2"], SCHEMA).await?;
    let writer = small_writer(&c, 0, "small", 3000);
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(700)).await;
        c.agents[1].kill9()?;
        tokio::time::sleep(Duration::from_millis(300)).await;
        c.agents[1].start()?;
        c.agents[1].wait_ready(Duration::from_secs(30)).await?;
    }
    writer.await??;
    // One large transaction; kill the subscriber's agent while it applies it.
    c.pg[0]
        .execute("INSERT INTO events SELECT 'large', g, repeat('y', 50) FROM generate_series(1, 200000) g")
        .await?;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    c.agents[1].kill9()?;
    c.agents[1].start()?;
    c.agents[1].wait_ready(Duration::from_secs(30)).await?;
    c.wait_sync(180).await?;
    assert_eq!(counts(&c, 1, "small").await?, (3000, 3000));
    assert_eq!(counts(&c, 1, "large").await?, (200000, 200000));
    // And the publisher's agent: kill it too while writes continue.
    let writer = small_writer(&c, 0, "small2", 1000);
    tokio::time::sleep(Duration::from_millis(500)).await;
    c.agents[0].kill9()?;
    c.agents[0].start()?;
    c.agents[0].wait_ready(Duration::from_secs(30)).await?;
    writer.await??;
    c.wait_sync(120).await?;
    assert_eq!(counts(&c, 1, "small2").await?, (1000, 1000));
    c.assert_same("SELECT origin, seq, payload FROM events ORDER BY 1, 2")
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_postgres_mid_stream() -> Result<()> {
    mm_tests::init_tracing();
    let c = TestCluster::start(&["p1", "p2"], SCHEMA).await?;
    // Subscriber crashes (immediate shutdown = crash recovery on restart).
    let writer = small_writer(&c, 0, "to_p2", 2000);
    tokio::time::sleep(Duration::from_millis(800)).await;
    c.pg[1].stop_immediate()?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    c.pg[1].start_again()?;
    writer.await??;
    c.wait_sync(120).await?;
    assert_eq!(counts(&c, 1, "to_p2").await?, (2000, 2000));
    // Publisher crashes while its writes stream out; the writer stops with it.
    let writer = small_writer(&c, 0, "from_p1", 100000);
    tokio::time::sleep(Duration::from_millis(800)).await;
    c.pg[0].stop_immediate()?;
    let _ = writer.await?; // fails: the server went away
    c.pg[0].start_again()?;
    c.wait_sync(120).await?;
    let committed = counts(&c, 0, "from_p1").await?;
    assert!(committed.0 > 0);
    assert_eq!(committed.0, committed.1);
    assert_eq!(counts(&c, 1, "from_p1").await?, committed);
    Ok(())
}
