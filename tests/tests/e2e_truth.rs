//! Status, lag and wait-sync tell the truth (SPEC §4 status / wait-sync):
//!
//! * a paused stream with rows waiting, and a stream stopped by an error with
//!   hundreds of KB behind it, show that lag in bytes and seconds, in
//!   `mmctl status` and in `/metrics`;
//! * `wait-sync` fails at once, one line per stream, for a stream in error
//!   (naming peer, relation, LSN and cause) and for a paused stream with
//!   changes waiting (naming it and its lag) unless `--ignore-paused`; a
//!   paused stream with nothing waiting does not hold it up;
//! * `mmctl status` exits non-zero while a stream is in error and shows the
//!   whole error with what `mmctl skip` needs;
//! * applied and conflict counters survive an agent restart.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use mm_tests::TestCluster;

const SCHEMA: &str = "CREATE TABLE t (id int PRIMARY KEY, v text);";

/// Polls the stream's status until `ok` holds; returns it.
async fn wait_status(
    c: &TestCluster,
    from: &str,
    to: &str,
    what: &str,
    ok: impl Fn(&serde_json::Value) -> bool,
) -> Result<serde_json::Value> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = c.stream_status(from, to).await?;
        if ok(&s) {
            return Ok(s);
        }
        if Instant::now() > deadline {
            bail!("{from} -> {to}: {what} not seen; last status {s}");
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

fn lag(s: &serde_json::Value) -> (u64, f64) {
    (
        s["lag_bytes"].as_u64().unwrap_or(0),
        s["lag_seconds"].as_f64().unwrap_or(0.0),
    )
}

/// The value of `metric{from="..",to=".."}` in node `i`'s /metrics.
async fn metric(c: &TestCluster, i: usize, metric: &str, from: &str, to: &str) -> Result<f64> {
    let text = c.agents[i].metrics(&c.token_file()).await?;
    for line in text.lines() {
        if line.starts_with(metric)
            && line.contains(&format!("from=\"{from}\""))
            && line.contains(&format!("to=\"{to}\""))
        {
            let v = line.rsplit(' ').next().unwrap_or_default();
            return v.parse().with_context(|| format!("metric line {line}"));
        }
    }
    bail!("no {metric} for {from} -> {to} in:\n{text}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_stream_lag_and_wait_sync() -> Result<()> {
    mm_tests::init_tracing();
    let c = TestCluster::start(&["lp1", "lp2"], SCHEMA).await?;
    c.pg[0].execute("INSERT INTO t VALUES (0, 'first')").await?;
    c.wait_sync(60).await?;

    // A paused stream with nothing waiting does not hold wait-sync up, even
    // though its publisher's WAL moves (watermarks).
    c.pause("lp2", "lp1").await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    c.wait_sync(30)
        .await
        .context("a paused stream with nothing waiting must not fail wait-sync")?;

    // 5,000 rows wait behind the paused lp1 -> lp2.
    c.pause("lp1", "lp2").await?;
    c.pg[0]
        .execute(
            "DO $$ BEGIN FOR i IN 1..50 LOOP
               INSERT INTO t SELECT g, repeat('x', 50) FROM generate_series(i * 100, i * 100 + 99) g;
               COMMIT; END LOOP; END $$",
        )
        .await?;
    let s = wait_status(&c, "lp1", "lp2", "lag of a paused stream", |s| {
        let (b, t) = lag(s);
        b > 200_000 && t >= 1.0
    })
    .await?;
    ensure!(s["state"] == "paused", "{s}");
    let bytes = metric(&c, 1, "mm_stream_lag_bytes", "lp1", "lp2").await?;
    let secs = metric(&c, 1, "mm_stream_lag_seconds", "lp1", "lp2").await?;
    ensure!(
        bytes > 200_000.0 && secs >= 1.0,
        "/metrics: lag {bytes} bytes, {secs} s"
    );

    // wait-sync fails at once, naming the paused stream and its lag.
    let t0 = Instant::now();
    let out = c.mmctl(0, &["wait-sync", "--timeout", "60"]).await?;
    ensure!(
        !out.success() && t0.elapsed() < Duration::from_secs(20),
        "wait-sync with a paused stream behind: exit {:?} after {:?}\n{}{}",
        out.status,
        t0.elapsed(),
        out.stdout,
        out.stderr
    );
    let line = out
        .stderr
        .lines()
        .find(|l| l.contains("lp1 → lp2"))
        .with_context(|| format!("wait-sync does not name lp1 → lp2: {}", out.stderr))?;
    ensure!(
        line.contains("paused") && line.contains("lag") && line.contains("bytes"),
        "{line}"
    );
    ensure!(
        !out.stderr.contains("lp2 → lp1"),
        "the paused stream with nothing waiting was named: {}",
        out.stderr
    );
    // ... unless paused streams are left out on purpose.
    c.wait_sync_ignore_paused(60).await?;

    // A write behind the other paused stream, and wait-sync at once: the lag
    // it names is what waits now, not the agent's last lag probe (which runs
    // once a second and still said 0).
    c.pg[1].execute("INSERT INTO t VALUES (-1, 'late')").await?;
    let out = c.mmctl(0, &["wait-sync", "--timeout", "60"]).await?;
    let line = out
        .stderr
        .lines()
        .find(|l| l.contains("lp2 → lp1"))
        .with_context(|| format!("wait-sync does not name lp2 → lp1: {}", out.stderr))?;
    let bytes: u64 = line
        .split("lag ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("no lag in bytes: {line}"))?;
    ensure!(bytes > 0, "a row waits, yet: {line}");

    c.resume("lp1", "lp2").await?;
    c.resume("lp2", "lp1").await?;
    c.wait_sync(90).await?;
    c.assert_same("SELECT count(*), sum(id) FROM t").await?;
    wait_status(&c, "lp1", "lp2", "no lag once caught up", |s| {
        s["state"] == "streaming" && lag(s) == (0, 0.0)
    })
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_in_error_lag_wait_sync_status_and_counters() -> Result<()> {
    mm_tests::init_tracing();
    let mut c = TestCluster::start(&["le1", "le2"], SCHEMA).await?;
    // Two conflicts and some applied transactions first, for the counters.
    c.pause("le1", "le2").await?;
    c.pause("le2", "le1").await?;
    c.pg[0].execute("INSERT INTO t VALUES (1, 'a')").await?;
    c.pg[1].execute("INSERT INTO t VALUES (1, 'b')").await?;
    c.resume("le1", "le2").await?;
    c.resume("le2", "le1").await?;
    for i in 10..20 {
        c.pg[0]
            .execute(&format!("INSERT INTO t VALUES ({i}, 'x')"))
            .await?;
    }
    c.wait_sync(60).await?;
    let before = c.stream_status("le1", "le2").await?;
    ensure!(
        before["applied_txns"].as_u64() >= Some(11)
            && before["conflicts"]["insert_exists"].as_u64() == Some(1),
        "{before}"
    );

    // A table le2 does not have: le1 -> le2 stops at that transaction, and
    // ~400 KB of later changes to t wait behind it.
    c.pg[0]
        .execute("CREATE TABLE only_on_le1 (id int PRIMARY KEY)")
        .await?;
    c.pg[0]
        .execute("INSERT INTO only_on_le1 VALUES (1)")
        .await?;
    c.pg[0]
        .execute("INSERT INTO t SELECT g, repeat('y', 300) FROM generate_series(1000, 2000) g")
        .await?;
    let s = wait_status(&c, "le1", "le2", "error with lag", |s| {
        let (b, t) = lag(s);
        s["state"] == "error" && b > 300_000 && t > 0.0
    })
    .await?;
    let err = s["last_error"].as_str().unwrap_or_default().to_owned();
    ensure!(
        err.contains("le1") && err.contains("public.only_on_le1") && err.contains("commit LSN"),
        "{err}"
    );
    let stuck = s["stuck_lsn"]
        .as_str()
        .with_context(|| format!("no stuck_lsn in {s}"))?
        .to_owned();
    ensure!(err.contains(&stuck), "error {err} does not name {stuck}");
    let bytes = metric(&c, 1, "mm_stream_lag_bytes", "le1", "le2").await?;
    ensure!(bytes > 300_000.0, "/metrics lag {bytes}");

    // wait-sync: at once, naming peer, relation, LSN and cause.
    let t0 = Instant::now();
    let out = c.mmctl(0, &["wait-sync", "--timeout", "60"]).await?;
    ensure!(
        !out.success() && t0.elapsed() < Duration::from_secs(20),
        "wait-sync with a stream in error: exit {:?} after {:?}\n{}",
        out.status,
        t0.elapsed(),
        out.stderr
    );
    let line = out
        .stderr
        .lines()
        .find(|l| l.contains("le1 → le2"))
        .with_context(|| format!("wait-sync does not name le1 → le2: {}", out.stderr))?;
    for want in ["public.only_on_le1", &stuck, "does not exist"] {
        ensure!(line.contains(want), "{want} missing from: {line}");
    }

    // status: non-zero exit, the whole error and the skip command.
    let out = c.mmctl(1, &["status"]).await?;
    ensure!(!out.success(), "status exits 0 with a stream in error");
    ensure!(
        out.stdout.contains("Streams in error")
            && out.stdout.contains("does not exist on this node")
            && out
                .stdout
                .contains(&format!("skip --from le1 --lsn {stuck}")),
        "status does not show the whole error:\n{}",
        out.stdout
    );
    // Refusing a skip of an LSN the stream is not stopped at.
    let out = c
        .mmctl(1, &["skip", "--from", "le1", "--lsn", "0/10"])
        .await?;
    ensure!(
        !out.success() && out.stderr.contains("not stopped at 0/10"),
        "{}",
        out.stderr
    );
    let pending = c.rows(1, "SELECT count(*) FROM mm.skip_requests").await?;
    ensure!(pending == vec![vec![Some("0".into())]], "{pending:?}");

    // Fixed by the operator: the stream moves on by itself.
    c.pg[1]
        .execute("CREATE TABLE only_on_le1 (id int PRIMARY KEY)")
        .await?;
    // Until its next retry (backoff) the stream still shows the error.
    wait_status(&c, "le1", "le2", "streaming after the fix", |s| {
        s["state"] == "streaming" && s["stuck_lsn"].is_null()
    })
    .await?;
    c.wait_sync(120).await?;
    c.assert_same("SELECT count(*), sum(id) FROM t").await?;
    let out = c.mmctl(1, &["status"]).await?;
    ensure!(out.success(), "status after the fix: {}", out.stderr);

    // Counters survive an agent restart.
    let before = c.stream_status("le1", "le2").await?;
    c.agents[1].stop()?;
    c.agents[1].start()?;
    c.agents[1].wait_ready(Duration::from_secs(30)).await?;
    let after = wait_status(&c, "le1", "le2", "streaming after restart", |s| {
        s["state"] == "streaming"
    })
    .await?;
    ensure!(
        after["applied_txns"] == before["applied_txns"]
            && after["conflicts"] == before["conflicts"],
        "counters before the restart {before}\nafter {after}"
    );
    Ok(())
}

/// wait-sync started while an agent restarts (its process is back before
/// its API listens, or not back yet) waits for it within its timeout
/// instead of failing at once with "connection refused": the supervisor
/// restarts a killed agent, and an operator's wait-sync should ride that
/// out. (Seen in the Ansible test: the agent came back, wait-sync did not
/// wait for it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_sync_waits_for_a_restarting_agent() -> Result<()> {
    mm_tests::init_tracing();
    let mut c = TestCluster::start(&["wr1", "wr2"], SCHEMA).await?;
    c.agents[1].kill9()?;
    c.pg[0]
        .execute("INSERT INTO t VALUES (1, 'while wr2 was down')")
        .await?;
    let (url, token) = (c.agents[0].url(), c.token_file());
    let waiter = tokio::spawn(async move {
        mm_tests::mmctl(&url, &token, &["wait-sync", "--timeout", "60"]).await
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    ensure!(
        !waiter.is_finished(),
        "wait-sync gave up while wr2's agent was down"
    );
    c.agents[1].start()?;
    let out = waiter.await??;
    ensure!(
        out.success(),
        "wait-sync failed across the restart: {}{}",
        out.stderr,
        out.stdout
    );
    let got = c.pg[1]
        .query_one_string("SELECT v FROM t WHERE id = 1")
        .await?;
    ensure!(
        got.as_deref() == Some("while wr2 was down"),
        "wr2 has {got:?}"
    );
    Ok(())
}
