//! Decode throughput: how fast mm-proto's replication client and pgoutput
//! decoder consume a logical replication stream, next to PostgreSQL's own
//! `pg_recvlogical` on the same WAL, and how fast decoding alone is.
//!
//! One PostgreSQL node, one publication, two slots created before the
//! workload so both see exactly the same changes: `pg_recvlogical` drains
//! one to /dev/null, our client drains the other (decoding every message
//! with `StreamTracker`), and the payloads captured from the second run are
//! then decoded again in memory, with no network or server in the way.
//!
//! `cargo run --release -p mm-tests --bin decode-bench [-- --rows N --txns N --updates N]`

use std::hint::black_box;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use bytes::Bytes;
use mm_proto::Lsn;
use mm_proto::client::{ReplicationClient, ReplicationConfig, SnapshotAction};
use mm_proto::pgoutput::{Message, StreamTracker};
use mm_proto::walsender::{ServerMessage, StandbyStatusUpdate};
use mm_tests::{PgNode, PgOptions, pg_bin_dir};

/// pg_recvlogical's default `--status-interval`; ours matches it so both
/// clients cost the server the same.
const STATUS_INTERVAL: Duration = Duration::from_secs(10);
/// The in-memory decode repeats until it has run this long, for a stable figure.
const MIN_DECODE_TIME: Duration = Duration::from_secs(2);
/// The same options for both clients (pg_recvlogical's `-o` pairs).
const OPTIONS: [(&str, &str); 2] = [("proto_version", "4"), ("publication_names", "mm")];

struct Workload {
    rows: u64,
    txns: u64,
    updates: u64,
    update_txns: u64,
}

impl Workload {
    fn from_args() -> Result<Workload> {
        let mut w = Workload {
            rows: 200_000,
            txns: 2_000,
            updates: 50_000,
            update_txns: 500,
        };
        let mut args = std::env::args().skip(1);
        while let Some(flag) = args.next() {
            let value: u64 = args
                .next()
                .with_context(|| format!("{flag} needs a value"))?
                .parse()
                .with_context(|| format!("{flag} needs a number"))?;
            match flag.as_str() {
                "--rows" => w.rows = value,
                "--txns" => w.txns = value,
                "--updates" => w.updates = value,
                "--update-txns" => w.update_txns = value,
                _ => bail!("unknown flag {flag}; known: --rows --txns --updates --update-txns"),
            }
        }
        ensure!(
            w.txns > 0
                && w.update_txns > 0
                && w.rows.is_multiple_of(w.txns)
                && w.updates.is_multiple_of(w.update_txns),
            "rows/updates must be multiples of their transaction counts"
        );
        ensure!(w.updates <= w.rows, "cannot update more rows than inserted");
        Ok(w)
    }
}

/// Throughput figures of one run.
struct Measured {
    messages: u64,
    bytes: u64,
    seconds: f64,
}

impl Measured {
    fn print(&self, name: &str) {
        println!(
            "{name:<28} {:>10} {:>12} {:>9.3} {:>12.0} {:>9.2}",
            self.messages,
            self.bytes,
            self.seconds,
            self.messages as f64 / self.seconds,
            self.bytes as f64 / self.seconds / 1e6
        );
    }
}

/// What our client saw: the figures plus the raw payloads for the
/// in-memory run and the stream's shape for sanity checks.
struct Streamed {
    measured: Measured,
    captured: Vec<Bytes>,
    commits: u64,
    changes: u64,
    last_commit_lsn: Lsn,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let work = Workload::from_args()?;
    let node = PgNode::start_with(
        "decode-bench",
        PgOptions::default().conf("autovacuum", "off"),
    )?;
    let config = ReplicationConfig::from_dsn(&node.dsn())?.with_portable_text_settings();

    node.execute(
        "CREATE TABLE bench (id bigint PRIMARY KEY, account int NOT NULL,
                             amount numeric(12,2) NOT NULL, note text,
                             created timestamptz NOT NULL DEFAULT now());
         CREATE PUBLICATION mm FOR ALL TABLES;
         -- Single-row statements, a COMMIT every per_txn rows: the shape of
         -- OLTP traffic, generated server-side so the client is no bottleneck.
         CREATE PROCEDURE gen_inserts(txns bigint, per_txn bigint) LANGUAGE plpgsql AS $$
         DECLARE k bigint;
         BEGIN
           FOR t IN 0..txns - 1 LOOP
             FOR i IN 1..per_txn LOOP
               k := t * per_txn + i;
               INSERT INTO bench (id, account, amount, note)
                 VALUES (k, k % 1000, (k % 100000) / 100.0, 'note ' || k);
             END LOOP;
             COMMIT;
           END LOOP;
         END $$;
         CREATE PROCEDURE gen_updates(txns bigint, per_txn bigint, stride bigint)
         LANGUAGE plpgsql AS $$
         BEGIN
           FOR t IN 0..txns - 1 LOOP
             FOR i IN 1..per_txn LOOP
               UPDATE bench SET amount = amount + 1, note = 'updated'
                 WHERE id = (t * per_txn + i) * stride;
             END LOOP;
             COMMIT;
           END LOOP;
         END $$;",
    )
    .await?;

    let mut client = ReplicationClient::connect(&config).await?;
    for slot in ["s1", "s2"] {
        client
            .create_logical_slot(slot, "pgoutput", SnapshotAction::NoExport, false)
            .await?;
    }
    client.close().await;

    let started = Instant::now();
    node.execute(&format!(
        "CALL gen_inserts({}, {})",
        work.txns,
        work.rows / work.txns
    ))
    .await?;
    node.execute(&format!(
        "CALL gen_updates({}, {}, {})",
        work.update_txns,
        work.updates / work.update_txns,
        (work.rows / work.updates.max(1)).max(1)
    ))
    .await?;
    let generated = started.elapsed();
    // Flush the workload's dirty buffers now, so the checkpointer does not
    // compete with whichever measurement happens to run first.
    node.execute("CHECKPOINT").await?;
    let endpos: Lsn = node
        .query_one_string("SELECT pg_current_wal_lsn()::text")
        .await?
        .context("no WAL position")?
        .parse()?;
    let wal_bytes = node
        .query_one_string(&format!(
            "SELECT pg_wal_lsn_diff('{endpos}', confirmed_flush_lsn)::bigint
             FROM pg_replication_slots WHERE slot_name = 's2'"
        ))
        .await?
        .unwrap_or_default();
    println!(
        "workload: {} single-row inserts in {} transactions + {} single-row updates in {} \
         transactions, generated in {:.1}s; {wal_bytes} bytes of WAL to decode, endpos {endpos}",
        work.rows,
        work.txns,
        work.updates,
        work.update_txns,
        generated.as_secs_f64()
    );

    // (a) pg_recvlogical, slot s1.
    let pg_seconds = run_pg_recvlogical(&node, endpos)?;
    let s1_flush: Lsn = node
        .query_one_string(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 's1'",
        )
        .await?
        .context("s1 has no confirmed_flush_lsn")?
        .parse()?;

    // (b) our client, slot s2.
    let ours = run_client(&config, endpos).await?;
    let expected_commits = work.txns + work.update_txns;
    ensure!(
        ours.commits == expected_commits && ours.changes == work.rows + work.updates,
        "decoded {} commits / {} changes, expected {expected_commits} / {}",
        ours.commits,
        ours.changes,
        work.rows + work.updates
    );
    // pg_recvlogical confirms what it wrote when it stops: it must have got
    // through the same last transaction.
    ensure!(
        s1_flush >= ours.last_commit_lsn,
        "pg_recvlogical stopped at {s1_flush}, before the last commit at {}",
        ours.last_commit_lsn
    );

    // (c) the captured payloads, decoded in memory.
    let decode_only = decode_in_memory(&ours.captured)?;

    let pg = Measured {
        // The same slot contents: pg_recvlogical received the same messages.
        messages: ours.measured.messages,
        bytes: ours.measured.bytes,
        seconds: pg_seconds,
    };
    println!(
        "\n{:<28} {:>10} {:>12} {:>9} {:>12} {:>9}",
        "", "messages", "bytes", "seconds", "msgs/s", "MB/s"
    );
    pg.print("(a) pg_recvlogical");
    ours.measured.print("(b) mm client + decode");
    decode_only.print("(c) mm decode only (memory)");
    println!(
        "\nratio mm/pg_recvlogical (throughput, = pg time / mm time): {:.2}",
        pg.seconds / ours.measured.seconds
    );
    println!(
        "(b) stream: {} commits, {} row changes; bytes are pgoutput payloads (XLogData data)",
        ours.commits, ours.changes
    );
    Ok(())
}

/// Wall time of `pg_recvlogical` streaming slot s1 to `endpos` into /dev/null.
fn run_pg_recvlogical(node: &PgNode, endpos: Lsn) -> Result<f64> {
    let dsn = format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres",
        node.port()
    );
    let mut cmd = Command::new(pg_bin_dir()?.join("pg_recvlogical"));
    cmd.args(["-d", &dsn, "--slot", "s1", "--start", "--no-loop"])
        .args(["--endpos", &endpos.to_string(), "-f", "/dev/null"]);
    for (k, v) in OPTIONS {
        cmd.args(["-o", &format!("{k}={v}")]);
    }
    let started = Instant::now();
    let out = cmd.output().context("running pg_recvlogical")?;
    let seconds = started.elapsed().as_secs_f64();
    ensure!(
        out.status.success(),
        "pg_recvlogical failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(seconds)
}

/// Streams slot s2 to `endpos` with mm's client, decoding every message and
/// keeping each payload, and stops by pg_recvlogical's rules: at a message
/// past `endpos`, or at a keepalive past it when no transaction is open.
async fn run_client(config: &ReplicationConfig, endpos: Lsn) -> Result<Streamed> {
    let started = Instant::now();
    let client = ReplicationClient::connect(config).await?;
    let mut stream = client
        .start_logical_replication("s2", Lsn::INVALID, &OPTIONS)
        .await?;
    let mut tracker = StreamTracker::new(4, false);
    let mut captured = Vec::new();
    let (mut bytes, mut commits, mut changes) = (0u64, 0u64, 0u64);
    let mut open = false;
    let mut flushed = Lsn::INVALID;
    let mut last_status = Instant::now();
    let mut last_commit_lsn = Lsn::INVALID;
    loop {
        let msg = match stream.next().await {
            Some(m) => m?,
            None => bail!("the server ended the stream before endpos {endpos}"),
        };
        let mut reply = last_status.elapsed() >= STATUS_INTERVAL;
        match msg {
            ServerMessage::XLogData {
                wal_start, data, ..
            } => {
                if wal_start > endpos {
                    break;
                }
                bytes += data.len() as u64;
                let decoded = tracker
                    .decode(data.clone())
                    .with_context(|| format!("decoding the message at {wal_start}"))?;
                captured.push(data);
                match decoded {
                    Message::Begin(_) => open = true,
                    Message::Commit(c) => {
                        open = false;
                        commits += 1;
                        flushed = c.end_lsn;
                        last_commit_lsn = c.commit_lsn;
                    }
                    Message::Insert(_) | Message::Update(_) | Message::Delete(_) => changes += 1,
                    _ => {}
                }
                if wal_start == endpos {
                    break;
                }
            }
            ServerMessage::PrimaryKeepalive {
                wal_end,
                reply_requested,
                ..
            } => {
                if wal_end >= endpos && !open {
                    break;
                }
                reply |= reply_requested;
            }
        }
        if reply {
            stream
                .send_status(&StandbyStatusUpdate::all(flushed))
                .await?;
            last_status = Instant::now();
        }
    }
    // Timed like pg_recvlogical, which also confirms its position on the way out.
    if !flushed.is_invalid() {
        stream
            .send_status(&StandbyStatusUpdate::all(flushed))
            .await?;
    }
    let seconds = started.elapsed().as_secs_f64();
    stream.finish().await?.close().await;
    Ok(Streamed {
        measured: Measured {
            messages: captured.len() as u64,
            bytes,
            seconds,
        },
        captured,
        commits,
        changes,
        last_commit_lsn,
    })
}

/// Decodes `captured` in order, repeatedly, and reports the mean rate.
fn decode_in_memory(captured: &[Bytes]) -> Result<Measured> {
    let bytes_per_pass: u64 = captured.iter().map(|b| b.len() as u64).sum();
    let started = Instant::now();
    let mut passes = 0u64;
    while passes < 3 || started.elapsed() < MIN_DECODE_TIME {
        let mut tracker = StreamTracker::new(4, false);
        for payload in captured {
            black_box(tracker.decode(black_box(payload.clone()))?);
        }
        passes += 1;
    }
    let seconds = started.elapsed().as_secs_f64();
    println!("(c) ran {passes} passes over the captured stream");
    Ok(Measured {
        messages: captured.len() as u64 * passes,
        bytes: bytes_per_pass * passes,
        seconds,
    })
}
