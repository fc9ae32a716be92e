//! Foreign keys across nodes: a child inserted on A while its parent is
//! deleted on B leaves an orphan on every node (each change was valid where
//! it was made; apply sessions do not run foreign-key triggers). mm keeps
//! both rows alike everywhere and says so: a `foreign_key_orphan` row in
//! each node's `mm.conflict_log`, counted in status, logged with relation.
//! Parents and children written together raise nothing.

use std::time::Duration;

use anyhow::{Result, ensure};
use mm_tests::TestCluster;

const SCHEMA: &str = "
CREATE TABLE parent (id int PRIMARY KEY, name text);
CREATE TABLE child (id int PRIMARY KEY, parent_id int REFERENCES parent (id), note text);";

fn one(v: &str) -> Vec<Vec<Option<String>>> {
    vec![vec![Some(v.to_owned())]]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orphan_from_concurrent_child_insert_and_parent_delete_is_reported() -> Result<()> {
    mm_tests::init_tracing();
    let c = TestCluster::start(&["fk1", "fk2"], SCHEMA).await?;
    // Written together (one transaction, child first with the parent after
    // it is not possible without deferral; parent first), and alone: no
    // orphan anywhere.
    c.pg[0]
        .execute("BEGIN; INSERT INTO parent VALUES (1, 'p1'), (2, 'p2'); INSERT INTO child VALUES (20, 2, 'c'); COMMIT")
        .await?;
    c.pg[0]
        .execute("INSERT INTO child VALUES (21, 2, 'alone')")
        .await?;
    c.pg[1]
        .execute("UPDATE child SET note = 'upd' WHERE id = 20")
        .await?;
    c.wait_sync(60).await?;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    for i in 0..2 {
        let n = c.rows(i, "SELECT count(*) FROM mm.conflict_log").await?;
        ensure!(n == one("0"), "{}: conflicts before: {n:?}", c.pg[i].name());
    }

    c.pause("fk1", "fk2").await?;
    c.pause("fk2", "fk1").await?;
    c.pg[0]
        .execute("INSERT INTO child VALUES (10, 1, 'orphan to be')")
        .await?;
    c.pg[1].execute("DELETE FROM parent WHERE id = 1").await?;
    c.resume("fk1", "fk2").await?;
    c.resume("fk2", "fk1").await?;
    c.wait_sync(60).await?;

    // Alike everywhere: the child kept, the parent gone.
    c.assert_same("SELECT id, parent_id, note FROM child ORDER BY id")
        .await?;
    c.assert_same("SELECT id FROM parent ORDER BY id").await?;
    let orphans = c
        .assert_same(
            "SELECT c.id FROM child c WHERE NOT EXISTS (SELECT 1 FROM parent p WHERE p.id = c.parent_id)",
        )
        .await?;
    ensure!(orphans == one("10"), "orphans: {orphans:?}");

    // Each node reports it: on fk1 when fk2's delete arrived, on fk2 when
    // fk1's insert did.
    for (i, from) in [(0, "fk2"), (1, "fk1")] {
        let log = c
            .rows(
                i,
                "SELECT conflict_type, relation, key::text, remote_origin, resolution, \
                 remote_tuple->>'constraint', remote_tuple->>'references', remote_tuple->'parent_key'->>'id' \
                 FROM mm.conflict_log",
            )
            .await?;
        let want: Vec<Option<String>> = [
            "foreign_key_orphan",
            "public.child",
            r#"{"id": 10}"#,
            from,
            "kept",
            "child_parent_id_fkey",
            "public.parent",
            "1",
        ]
        .iter()
        .map(|s| Some((*s).to_owned()))
        .collect();
        ensure!(log == vec![want], "{}: {log:?}", c.pg[i].name());
        let to = c.pg[i].name().to_owned();
        let s = c.stream_status(from, &to).await?;
        ensure!(
            s["conflicts"]["foreign_key_orphan"].as_u64() == Some(1),
            "{from} -> {to}: {s}"
        );
        let agent_log = c.agents[i].log();
        ensure!(
            agent_log.contains("foreign key orphan") && agent_log.contains("public.child"),
            "agent {to} does not log the orphan"
        );
    }
    Ok(())
}
