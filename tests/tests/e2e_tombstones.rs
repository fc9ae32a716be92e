//! Tombstones: written for remote and local deletes (also on tables created
//! after the agent started), visible as a count in status and /metrics, and
//! purged once every node has applied past them; found by their key's
//! hash since schema version 8, which keeps the versions of those written
//! before.

use std::time::Duration;

use anyhow::Result;
use mm_agent::apply::{TOMBSTONES_KEY, sql};
use mm_tests::PgNode;
use mm_tests::cluster::TestCluster;
use mm_tests::versions::{utc, write_under_origin};

const SCHEMA: &str = "CREATE TABLE kv (id int PRIMARY KEY, v text);";

/// The first column of every row of `sql`, as text.
async fn texts(c: &tokio_postgres::Client, sql: &str) -> Result<Vec<String>> {
    Ok(c.query(sql, &[]).await?.iter().map(|r| r.get(0)).collect())
}

async fn tombstones(c: &TestCluster, i: usize) -> Result<i64> {
    let r = c.rows(i, "SELECT count(*) FROM mm.tombstones").await?;
    Ok(r[0][0].as_deref().unwrap_or("0").parse()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tombstones_are_written_counted_and_purged() -> Result<()> {
    mm_tests::init_tracing();
    let c = TestCluster::start(&["tb1", "tb2", "tb3"], SCHEMA).await?;
    // A table created after the agents started gets the local-delete
    // trigger from the event trigger.
    for pg in &c.pg {
        pg.execute("CREATE TABLE late (k text PRIMARY KEY, n int)")
            .await?;
    }
    c.pg[0]
        .execute("INSERT INTO kv SELECT g, 'v' FROM generate_series(1, 10) g")
        .await?;
    c.pg[1]
        .execute("INSERT INTO late VALUES ('a', 1), ('b', 2)")
        .await?;
    c.wait_sync(60).await?;

    // Pause everything out of tb1 so its local delete's tombstone can be
    // seen before anyone can have applied it.
    c.pause("tb1", "tb2").await?;
    c.pause("tb1", "tb3").await?;
    c.pg[0].execute("DELETE FROM kv WHERE id <= 3").await?;
    c.pg[1].execute("DELETE FROM late WHERE k = 'a'").await?;
    let local_key = c
        .rows(
            0,
            "SELECT key::text FROM mm.tombstones WHERE relid = 'kv'::regclass ORDER BY key::text",
        )
        .await?;
    assert_eq!(
        local_key,
        vec![
            vec![Some(r#"{"id": 1}"#.to_owned())],
            vec![Some(r#"{"id": 2}"#.to_owned())],
            vec![Some(r#"{"id": 3}"#.to_owned())],
        ],
        "a local DELETE leaves one tombstone per key"
    );
    // tb2's local delete on the late table: a tombstone there, and one on
    // the other nodes once applied (tb3 now; tb1 too, its inbound streams run).
    let late_key = c
        .rows(
            1,
            "SELECT key::text FROM mm.tombstones WHERE relid = 'late'::regclass",
        )
        .await?;
    assert_eq!(late_key, vec![vec![Some(r#"{"k": "a"}"#.to_owned())]]);
    // While tb1's deletes have reached nobody, they cannot be purged on tb1:
    // give the purge task (every 5 s) time to run, and check they stay.
    tokio::time::sleep(Duration::from_secs(7)).await;
    assert!(
        tombstones(&c, 0).await? >= 3,
        "tb1 purged tombstones of deletes its peers have not applied"
    );
    let status = c.status_json(0).await?;
    assert!(
        status.to_string().contains("\"tombstones\":"),
        "status shows the tombstone count: {status}"
    );

    c.resume("tb1", "tb2").await?;
    c.resume("tb1", "tb3").await?;
    c.wait_sync(60).await?;
    c.assert_same("SELECT id, v FROM kv ORDER BY id").await?;
    c.assert_same("SELECT k, n FROM late ORDER BY k").await?;
    // Every node has applied every delete: the tombstones go, everywhere.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let mut counts = Vec::new();
        for i in 0..3 {
            counts.push(tombstones(&c, i).await?);
        }
        if counts.iter().all(|n| *n == 0) {
            break;
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "tombstones never purged: {counts:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let metrics = c.agents[0].metrics(&c.token_file()).await?;
    assert!(
        metrics.contains("mm_tombstones"),
        "the tombstone gauge is exported: {metrics}"
    );
    Ok(())
}

/// Deletes write their tombstones with a plain INSERT (the cheap form); a
/// key deleted again before its tombstone is purged makes that INSERT
/// fail on the key's tombstone. The delete is then redone with the
/// resolver, the tombstone raised to the later delete's version (as the
/// publisher's own), and the table's deletes upsert for a while. The
/// third node stays down throughout, so no tombstone can be purged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_deleted_again_before_its_tombstone_is_purged_raises_it() -> Result<()> {
    mm_tests::init_tracing();
    let mut c = TestCluster::start(&["tr1", "tr2", "tr3"], SCHEMA).await?;
    c.pg[0]
        .execute("INSERT INTO kv SELECT g, 'v' FROM generate_series(1, 40) g")
        .await?;
    c.wait_sync(60).await?;
    c.agents[2].stop()?;
    let long = Duration::from_secs(60);
    let client = c.pg[0].connect().await?;
    for id in 1..=40 {
        client
            .batch_execute(&format!("DELETE FROM kv WHERE id = {id}"))
            .await?;
    }
    c.wait_for(
        1,
        "SELECT count(*) FROM mm.tombstones WHERE relid = 'kv'::regclass",
        "40",
        long,
    )
    .await?;
    // Back, and deleted again: each its own transaction.
    for id in 1..=40 {
        client
            .batch_execute(&format!("INSERT INTO kv VALUES ({id}, 'again')"))
            .await?;
    }
    for id in 1..=40 {
        client
            .batch_execute(&format!("DELETE FROM kv WHERE id = {id}"))
            .await?;
    }
    client
        .batch_execute("INSERT INTO kv VALUES (1000, 'fence')")
        .await?;
    c.wait_for(1, "SELECT count(*) FROM kv", "1", long).await?;
    let versions = "SELECT key::text, pg_xact_commit_timestamp(xmin) FROM mm.tombstones \
                    WHERE relid = 'kv'::regclass ORDER BY key::text";
    let published = c.rows(0, versions).await?;
    let applied = c.rows(1, versions).await?;
    anyhow::ensure!(
        published.len() == 40,
        "{} tombstones on tr1",
        published.len()
    );
    anyhow::ensure!(
        applied == published,
        "tr2's tombstones are not at the second deletes' versions:\n{applied:?}\nwant\n{published:?}"
    );
    let log = c.agents[1].log();
    anyhow::ensure!(
        log.contains("deletes upsert theirs for a while"),
        "tr2 never met a tombstone with a plain INSERT (the path this test is for)"
    );
    c.agents[2].start()?;
    c.agents[2].wait_ready(long).await?;
    c.wait_sync(120).await?;
    c.assert_same("SELECT id, v FROM kv ORDER BY id").await?;
    Ok(())
}

/// Schema version 8 replaces the tombstones' primary key with a unique
/// index that compares the key's hash first. A tombstone written before
/// keeps its version (the xmin a table rewrite would have replaced), is
/// found by the careful path's lookup, makes a plain INSERT of an equal
/// key (7.0 is 7 to jsonb) fail on the index the agent reads as "this key
/// has a tombstone", and is raised by the upsert.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tombstones_written_before_schema_8_keep_their_versions() -> Result<()> {
    mm_tests::init_tracing();
    let pg = PgNode::start("tbv8")?;
    let c = pg.connect().await?;
    c.batch_execute(
        "CREATE SCHEMA mm;
         CREATE TABLE mm.schema_migrations (version int PRIMARY KEY,
                                            applied_at timestamptz NOT NULL DEFAULT now());
         CREATE TABLE kv (id int PRIMARY KEY, v text);
         SELECT pg_replication_origin_create('peer');",
    )
    .await?;
    for (version, migration) in mm_agent::schema::MIGRATIONS.iter().filter(|(v, _)| *v < 8) {
        c.batch_execute(migration).await?;
        c.execute(
            "INSERT INTO mm.schema_migrations (version) VALUES ($1)",
            &[version],
        )
        .await?;
    }
    let at = "2026-01-02T03:04:05Z";
    write_under_origin(
        &pg,
        "peer",
        at,
        "INSERT INTO mm.tombstones (relid, key) VALUES ('kv'::regclass, '{\"id\": 7}')",
    )
    .await?;
    mm_agent::schema::ensure(&c, &["public".to_owned()]).await?;

    let relid: u32 = c.query_one("SELECT 'kv'::regclass::oid", &[]).await?.get(0);
    let peer: u32 = c
        .query_one(
            "SELECT roident::oid FROM pg_replication_origin WHERE roname = 'peer'",
            &[],
        )
        .await?
        .get(0);
    let lookup = sql::tombstone_lookup(relid, &["id"], &["integer"]);
    let found = c.query(&lookup, &[&7i32]).await?;
    anyhow::ensure!(
        found.len() == 1,
        "{} tombstones found for id 7",
        found.len()
    );
    let (origin, ts): (u32, chrono::DateTime<chrono::Utc>) = (found[0].get(0), found[0].get(1));
    anyhow::ensure!(
        origin == peer && ts == utc(at),
        "the tombstone's version after the migration is ({origin}, {ts}), want ({peer}, {at})"
    );

    let plain = c
        .batch_execute(
            "INSERT INTO mm.tombstones (relid, key) VALUES ('kv'::regclass, '{\"id\": 7.0}')",
        )
        .await;
    let constraint = plain
        .as_ref()
        .err()
        .and_then(|e| e.as_db_error())
        .and_then(|d| d.constraint().map(str::to_owned));
    anyhow::ensure!(
        constraint.as_deref() == Some(TOMBSTONES_KEY),
        "a plain INSERT of an existing tombstone's key: {plain:?}"
    );
    c.execute(
        &sql::tombstone_upsert(relid, &["id"], &["integer"]),
        &[&7i32],
    )
    .await?;
    let found = c.query(&lookup, &[&7i32]).await?;
    let origin: u32 = found[0].get(0);
    anyhow::ensure!(
        found.len() == 1 && origin == 0,
        "the upsert did not raise the tombstone to this transaction: {} rows, origin {origin}",
        found.len()
    );
    Ok(())
}

/// The tombstone triggers carry the table's key (its index and columns) as
/// arguments, so a local DELETE does not query the catalog. A key changed
/// while the agent is down must still be honoured: deletes fall back to the
/// catalog at once, and the next start makes the triggers again for the
/// new key (the key-change trigger watches the key's columns); a start
/// that finds them current leaves them alone (no lock on the table).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_tombstones_follow_a_changed_key() -> Result<()> {
    mm_tests::init_tracing();
    let pg = PgNode::start("tbkey")?;
    let c = pg.connect().await?;
    c.batch_execute(
        r#"CREATE TABLE kv (id int PRIMARY KEY, v text NOT NULL, n int);
           CREATE TABLE full_kv (id int PRIMARY KEY, v text);
           ALTER TABLE full_kv REPLICA IDENTITY FULL;
           CREATE TABLE ri (a int NOT NULL, b int NOT NULL, c int);
           CREATE UNIQUE INDEX ri_ba ON ri (b, a);
           ALTER TABLE ri REPLICA IDENTITY USING INDEX ri_ba;
           CREATE TABLE "Odd ""t""" ("k 1" int, "K'2" text, PRIMARY KEY ("K'2", "k 1"));
           CREATE TABLE parted (id int PRIMARY KEY, v text) PARTITION BY RANGE (id);
           CREATE TABLE parted_1 PARTITION OF parted FOR VALUES FROM (0) TO (100);
           CREATE TABLE renamed (id int PRIMARY KEY, other int);"#,
    )
    .await?;
    mm_agent::schema::ensure(&c, &["public".to_owned()]).await?;
    let keys = |table: &'static str| {
        let c = &c;
        async move {
            let rows = c
                .query(
                    "SELECT key::text FROM mm.tombstones WHERE relid = $1::text::regclass ORDER BY key::text",
                    &[&table],
                )
                .await?;
            anyhow::Ok(
                rows.iter()
                    .map(|r| r.get::<_, String>(0))
                    .collect::<Vec<_>>(),
            )
        }
    };
    c.batch_execute(
        r#"INSERT INTO kv VALUES (1, 'a', 1), (2, 'b', 2), (3, 'c', 3);
           INSERT INTO full_kv VALUES (1, 'x');
           INSERT INTO ri VALUES (1, 2, 3);
           INSERT INTO "Odd ""t""" VALUES (1, 'q');
           INSERT INTO parted VALUES (5, 'p');
           DELETE FROM kv WHERE id = 1;
           DELETE FROM full_kv;
           DELETE FROM ri;
           DELETE FROM "Odd ""t""";
           DELETE FROM parted_1;"#,
    )
    .await?;
    assert_eq!(keys("kv").await?, [r#"{"id": 1}"#]);
    assert_eq!(
        keys("full_kv").await?,
        [r#"{"id": 1}"#],
        "FULL identity: keyed by the primary key"
    );
    assert_eq!(keys("ri").await?, [r#"{"a": 1, "b": 2}"#]);
    assert_eq!(keys(r#""Odd ""t""""#).await?, [r#"{"K'2": "q", "k 1": 1}"#]);
    assert_eq!(
        keys("parted").await?,
        [r#"{"id": 5}"#],
        "a partition's delete is keyed by its root"
    );

    let versions = "SELECT tgrelid::regclass::text, tgname, xmin::text FROM pg_trigger \
                    WHERE tgname LIKE 'mm\\_%' ORDER BY 1, 2";
    let before: Vec<(String, String, String)> = c
        .query(versions, &[])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    mm_agent::schema::ensure(&c, &["public".to_owned()]).await?;
    let again: Vec<(String, String, String)> = c
        .query(versions, &[])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        before, again,
        "a start that finds the triggers current made them again"
    );
    // A DELETE aimed at a partition takes no lock on its root, not even
    // for a moment: a TRUNCATE or ALTER of the root holding it while it
    // waits for the partition would deadlock with it.
    c.batch_execute("INSERT INTO parted_1 VALUES (6, 'q')")
        .await?;
    let holder = pg.connect().await?;
    holder
        .batch_execute("BEGIN; LOCK TABLE ONLY parted IN ACCESS EXCLUSIVE MODE")
        .await?;
    let deleted = c
        .batch_execute("SET lock_timeout = '3s'; DELETE FROM parted_1 WHERE id = 6")
        .await;
    holder.batch_execute("COMMIT").await?;
    c.batch_execute("RESET lock_timeout").await?;
    anyhow::ensure!(
        deleted.is_ok(),
        "a DELETE on a partition waited for its root: {deleted:?}"
    );
    assert_eq!(keys("parted").await?, [r#"{"id": 5}"#, r#"{"id": 6}"#]);
    // The event trigger installs in the user's session, whatever its
    // settings (a backslash literal failed with standard_conforming_strings off).
    // (A session of its own: a function is compiled once per session.)
    pg.connect()
        .await?
        .batch_execute(
            "SET standard_conforming_strings = off;
             CREATE TABLE late_scs (id int PRIMARY KEY);",
        )
        .await?;
    let made: i64 = c
        .query_one(
            "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'late_scs'::regclass AND tgname LIKE 'mm\\_%'",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(made, 3, "a new table's agent triggers");
    // A renamed key column keeps its index (and the trigger's arguments
    // their old name): the delete is keyed by the column's name now.
    c.batch_execute(
        "ALTER TABLE renamed RENAME COLUMN id TO ident;
         ALTER TABLE renamed RENAME COLUMN other TO id;
         INSERT INTO renamed VALUES (1, 2);
         DELETE FROM renamed;",
    )
    .await?;
    assert_eq!(keys("renamed").await?, [r#"{"ident": 1}"#]);

    // The key changes while the agent is down: deletes are keyed by the
    // new key at once, through the catalog.
    c.batch_execute(
        "ALTER TABLE kv DROP CONSTRAINT kv_pkey, ADD PRIMARY KEY (v);
         DELETE FROM kv WHERE id = 2;",
    )
    .await?;
    assert_eq!(keys("kv").await?, [r#"{"id": 1}"#, r#"{"v": "b"}"#]);
    // A start while a transaction holds the table does not wait for it
    // (every write to the table would queue behind the trigger's lock):
    // the triggers stay as they were, correct, until a later start.
    let other = pg.connect().await?;
    other
        .batch_execute("BEGIN; INSERT INTO kv VALUES (9, 'i', 9)")
        .await?;
    let started = std::time::Instant::now();
    tokio::time::timeout(
        Duration::from_secs(30),
        mm_agent::schema::ensure(&c, &["public".to_owned()]),
    )
    .await
    .map_err(|_| anyhow::anyhow!("a start waited for a transaction holding a table"))??;
    anyhow::ensure!(
        started.elapsed() < Duration::from_secs(10),
        "a start took {:?} with a table held",
        started.elapsed()
    );
    let watched = "SELECT pg_get_triggerdef(oid) FROM pg_trigger \
                   WHERE tgrelid = 'kv'::regclass AND tgname = 'mm_key_changes'";
    let def: String = c.query_one(watched, &[]).await?.get(0);
    anyhow::ensure!(def.contains("UPDATE OF id ON"), "{def}");
    // That trigger still fires on the old key's column: a row whose key
    // (v) did not change leaves no tombstone.
    c.batch_execute("UPDATE kv SET id = 30 WHERE id = 3")
        .await?;
    assert_eq!(
        keys("kv").await?,
        [r#"{"id": 1}"#, r#"{"v": "b"}"#],
        "an update that kept the row's key left a tombstone"
    );
    other.batch_execute("COMMIT").await?;
    // The next start makes the triggers for the new key: an update that
    // moves a row's new key leaves the old key's tombstone.
    mm_agent::schema::ensure(&c, &["public".to_owned()]).await?;
    let def: String = c.query_one(watched, &[]).await?.get(0);
    anyhow::ensure!(def.contains("UPDATE OF v ON"), "{def}");
    c.batch_execute("UPDATE kv SET v = 'z' WHERE id = 30")
        .await?;
    assert_eq!(
        keys("kv").await?,
        [r#"{"id": 1}"#, r#"{"v": "b"}"#, r#"{"v": "c"}"#],
        "the key-change trigger still watched the old key after a start"
    );
    c.batch_execute("DELETE FROM kv").await?;
    assert_eq!(
        keys("kv").await?,
        [
            r#"{"id": 1}"#,
            r#"{"v": "b"}"#,
            r#"{"v": "c"}"#,
            r#"{"v": "i"}"#,
            r#"{"v": "z"}"#
        ]
    );
    Ok(())
}

/// A role other than the agent's writes replicated tables with the grants
/// README lists (schema mm's usage, and the tombstone and truncate
/// tables): its deletes, truncates, key changes and new tables are
/// recorded as the agent's own would be. Without them the statement fails
/// whole, naming schema mm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_application_role_with_the_documented_grants_writes_replicated_tables() -> Result<()> {
    mm_tests::init_tracing();
    let pg = PgNode::start("tbrole")?;
    let c = pg.connect().await?;
    c.batch_execute(
        "CREATE TABLE kv (id int PRIMARY KEY, v text);
         CREATE TABLE parted (id int PRIMARY KEY) PARTITION BY RANGE (id);
         CREATE TABLE parted_1 PARTITION OF parted FOR VALUES FROM (0) TO (100);
         CREATE ROLE app;
         GRANT CREATE ON SCHEMA public TO app;
         GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON kv, parted, parted_1 TO app;
         INSERT INTO kv VALUES (1, 'a'), (2, 'b');
         INSERT INTO parted VALUES (1), (2);",
    )
    .await?;
    mm_agent::schema::ensure(&c, &["public".to_owned()]).await?;

    let denied = c
        .batch_execute("SET ROLE app; DELETE FROM kv WHERE id = 1")
        .await;
    c.batch_execute("RESET ROLE").await?;
    let message = denied
        .as_ref()
        .err()
        .and_then(|e| e.as_db_error())
        .map(|d| d.message().to_owned());
    anyhow::ensure!(
        message.as_deref() == Some("permission denied for schema mm"),
        "a DELETE without the grants: {denied:?}"
    );

    c.batch_execute(
        "GRANT USAGE ON SCHEMA mm TO app;
         GRANT SELECT, INSERT, UPDATE ON mm.tombstones, mm.truncates TO app;",
    )
    .await?;
    c.batch_execute(
        "SET ROLE app;
         DELETE FROM kv WHERE id = 1;
         UPDATE kv SET id = 3 WHERE id = 2;
         DELETE FROM parted WHERE id = 1;
         TRUNCATE parted_1;
         CREATE TABLE app_t (k text PRIMARY KEY);
         INSERT INTO app_t VALUES ('x');
         DELETE FROM app_t;
         TRUNCATE kv;
         RESET ROLE;",
    )
    .await?;
    let tombstones = texts(
        &c,
        "SELECT relid::regclass::text || ' ' || key::text FROM mm.tombstones ORDER BY 1",
    )
    .await?;
    assert_eq!(
        tombstones,
        [
            r#"app_t {"k": "x"}"#,
            r#"kv {"id": 1}"#,
            r#"kv {"id": 2}"#,
            r#"parted {"id": 1}"#
        ]
    );
    let truncated = texts(
        &c,
        "SELECT relid::regclass::text FROM mm.truncates ORDER BY 1",
    )
    .await?;
    assert_eq!(truncated, ["kv", "parted_1"]);
    Ok(())
}

/// Tombstones `mm.tombstones` on node `i` ever took (its statistics, which
/// backends flush within about a second of going idle): the purge cannot
/// hide one that was written.
async fn tombstones_inserted(c: &TestCluster, i: usize) -> Result<i64> {
    c.value(
        i,
        "SELECT n_tup_ins FROM pg_catalog.pg_stat_all_tables WHERE relid = 'mm.tombstones'::regclass",
    )
    .await
}

/// Deletes from the publisher, by one statement each (batched), and by
/// one statement over many rows, with the stream paused, on `c`'s node 1.
async fn backlog_of_deletes(c: &TestCluster) -> Result<()> {
    let from = c.agents[0].name.clone();
    let to = c.agents[1].name.clone();
    c.pg[0]
        .execute("INSERT INTO kv SELECT g, 'v' FROM generate_series(1, 400) g")
        .await?;
    c.wait_sync(60).await?;
    c.pause(&from, &to).await?;
    let each: Vec<String> = (1..=200)
        .map(|id| format!("DELETE FROM kv WHERE id = {id}"))
        .collect();
    c.run_each(0, &each).await?;
    c.pg[0].execute("DELETE FROM kv WHERE id > 300").await?;
    c.resume(&from, &to).await?;
    c.wait_sync(60).await?;
    let rows = c.assert_same("SELECT id, v FROM kv ORDER BY id").await?;
    anyhow::ensure!(rows.len() == 100, "{} rows left, want 100", rows.len());
    Ok(())
}

/// Waits until node `i` of `c` has written `want` tombstones (`what`).
async fn wait_inserted(c: &TestCluster, i: usize, want: i64, what: &str) -> Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let n = tombstones_inserted(c, i).await?;
        if n >= want {
            return Ok(());
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "{n} tombstones written on {} for {what}, want {want}",
            c.agents[i].name
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// In a cluster of two, a delete applied from the other node writes no
/// tombstone: only a third node's change could ever read it (the purge
/// would take it at once). With a third node in the cluster, the same
/// deletes write theirs. The publisher's own deletes keep their local
/// tombstones either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_deletes_write_tombstones_only_where_a_third_node_could_need_them() -> Result<()> {
    mm_tests::init_tracing();
    let three = TestCluster::start(&["tt1", "tt2", "tt3"], SCHEMA).await?;
    backlog_of_deletes(&three).await?;
    wait_inserted(&three, 1, 300, "tt1's deletes, a third node in the cluster").await?;
    drop(three);

    let two = TestCluster::start(&["tw1", "tw2"], SCHEMA).await?;
    backlog_of_deletes(&two).await?;
    wait_inserted(&two, 0, 300, "its own deletes").await?;
    // The apply session's statistics are flushed once its 300 deletes
    // show in them (they go together).
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let deleted =
        "SELECT n_tup_del FROM pg_catalog.pg_stat_all_tables WHERE relid = 'public.kv'::regclass";
    while two.value(1, deleted).await? < 300 {
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "tw2's statistics never showed the 300 deletes it applied"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let written = tombstones_inserted(&two, 1).await?;
    anyhow::ensure!(
        written == 0,
        "tw2 wrote {written} tombstones for deletes from its only peer"
    );
    Ok(())
}
