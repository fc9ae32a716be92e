//! remove-node (SPEC §4): a node that is up and one that is down leave the
//! cluster; no slot or origin of theirs remains on any node, the rest keeps
//! replicating, status lists only the remaining nodes, and the node that
//! was down is fenced when it comes back (it neither streams nor applies,
//! and does not recreate its slots). Also the Raft leader removing itself.

use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use mm_tests::TestCluster;

const SCHEMA: &str = "CREATE TABLE t (id int PRIMARY KEY, v text NOT NULL);";

/// The agent's slots on node `i`'s PostgreSQL, and the origins it still
/// keeps apply progress for. (Replication origins themselves stay: rows
/// and tombstones carry their ids, and a dropped id would be handed to the
/// next origin created.)
async fn owned(c: &TestCluster, i: usize) -> Result<Vec<String>> {
    let rows = c
        .rows(
            i,
            "SELECT slot_name::text FROM pg_replication_slots WHERE slot_name LIKE 'mm\\_%' \
             UNION ALL SELECT origin FROM mm.apply_progress ORDER BY 1",
        )
        .await?;
    Ok(rows
        .into_iter()
        .filter_map(|r| r.into_iter().next().flatten())
        .collect())
}

/// Waits until node `i` holds nothing mentioning `name` (its slots for it,
/// progress of its origin), or, with `all`, nothing at all.
async fn wait_clean(c: &TestCluster, i: usize, name: &str, all: bool) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left: Vec<String> = owned(c, i)
            .await?
            .into_iter()
            .filter(|o| all || o.ends_with(&format!("_to_{name}")) || *o == format!("mm_{name}"))
            .collect();
        if left.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("{} still holds {left:?}", c.pg[i].name());
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

async fn node_names(c: &TestCluster, via: usize) -> Result<Vec<String>> {
    let st = c.status_json(via).await?;
    let mut names: Vec<String> = st["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| n["name"].as_str().map(str::to_owned))
        .collect();
    names.sort();
    Ok(names)
}

async fn count(c: &TestCluster, i: usize) -> Result<String> {
    Ok(c.pg[i]
        .query_one_string("SELECT count(*) FROM t")
        .await?
        .unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remove_a_node_that_is_up_and_one_that_is_down() -> Result<()> {
    mm_tests::init_tracing();
    let mut c = TestCluster::start(&["rn1", "rn2", "rn3", "rn4"], SCHEMA).await?;
    for i in 0..4 {
        c.pg[i]
            .execute(&format!(
                "INSERT INTO t SELECT g, 'n{i}' FROM generate_series({0}, {0} + 99) g",
                i * 100 + 1
            ))
            .await?;
    }
    c.wait_sync(90).await?;

    // Up.
    let out = c.mmctl(0, &["remove-node", "--name", "rn4"]).await?;
    ensure!(
        out.success(),
        "remove-node rn4: {}{}",
        out.stderr,
        out.stdout
    );
    ensure!(out.stdout.contains("removed rn4"), "{}", out.stdout);
    for i in 0..3 {
        wait_clean(&c, i, "rn4", false).await?;
    }
    // It applied its own removal: the slots it published are gone too.
    wait_clean(&c, 3, "rn4", true).await?;

    // Down.
    c.agents[2].stop()?;
    let out = c.mmctl(0, &["remove-node", "--name", "rn3"]).await?;
    ensure!(
        out.success(),
        "remove-node rn3 (down): {}{}",
        out.stderr,
        out.stdout
    );
    for i in 0..2 {
        wait_clean(&c, i, "rn3", false).await?;
    }
    ensure!(
        node_names(&c, 0).await? == ["rn1", "rn2"],
        "status: {:?}",
        node_names(&c, 0).await?
    );
    ensure!(node_names(&c, 1).await? == ["rn1", "rn2"], "status on rn2");

    // The rest keeps replicating.
    c.pg[0]
        .execute("INSERT INTO t VALUES (1001, 'after')")
        .await?;
    c.pg[1]
        .execute("INSERT INTO t VALUES (1002, 'after')")
        .await?;
    c.wait_sync(60).await?;
    ensure!(
        count(&c, 0).await? == "402" && count(&c, 1).await? == "402",
        "rn1/rn2 rows"
    );

    // rn3 comes back: fenced. It drops the slots it published, recreates
    // none on the others, and applies nothing new.
    c.agents[2].start()?;
    c.agents[2].wait_ready(Duration::from_secs(30)).await?;
    wait_clean(&c, 2, "rn3", true).await?;
    c.pg[0]
        .execute("INSERT INTO t VALUES (1003, 'fenced?')")
        .await?;
    tokio::time::sleep(Duration::from_secs(8)).await;
    for i in 0..2 {
        let left = owned(&c, i).await?;
        ensure!(
            !left.iter().any(|o| o.contains("rn3") || o.contains("rn4")),
            "{} holds {left:?} after rn3 came back",
            c.pg[i].name()
        );
    }
    ensure!(
        count(&c, 2).await? == "400",
        "the fenced node applied new writes: {}",
        count(&c, 2).await?
    );
    let log = std::fs::read_to_string(c.agents[2].log_path())?;
    ensure!(
        log.contains("this node was removed from the cluster"),
        "rn3 did not say it is fenced"
    );
    c.wait_sync(60).await?;
    ensure!(
        count(&c, 1).await? == "403",
        "rn2 after the fenced node came back"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_raft_leader_can_remove_itself() -> Result<()> {
    mm_tests::init_tracing();
    let c = TestCluster::start(&["rl1", "rl2", "rl3"], SCHEMA).await?;
    let st = c.status_json(0).await?;
    let leader = st["leader"]["name"].as_str().unwrap_or_default().to_owned();
    let li = c.index_of(&leader)?;
    let other = (li + 1) % 3;
    let out = c.mmctl(li, &["remove-node", "--name", &leader]).await?;
    ensure!(
        out.success(),
        "leader {leader} removing itself: {}{}",
        out.stderr,
        out.stdout
    );
    let rest: Vec<usize> = (0..3).filter(|&i| i != li).collect();
    for &i in &rest {
        wait_clean(&c, i, &leader, false).await?;
    }
    // A new leader among the two left; they still replicate.
    let names = node_names(&c, other).await?;
    ensure!(
        names.len() == 2 && !names.contains(&leader),
        "status after: {names:?}"
    );
    c.pg[rest[0]]
        .execute("INSERT INTO t VALUES (1, 'x')")
        .await?;
    c.wait_for(
        rest[1],
        "SELECT v FROM t WHERE id = 1",
        "x",
        Duration::from_secs(30),
    )
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_an_unknown_node_is_one_clear_line() -> Result<()> {
    mm_tests::init_tracing();
    let c = TestCluster::start(&["ru1", "ru2"], SCHEMA).await?;
    let out = c.mmctl(0, &["remove-node", "--name", "nope"]).await?;
    ensure!(!out.success(), "removing an unknown node succeeded");
    ensure!(
        out.stderr.contains("unknown node nope") && out.stderr.trim().lines().count() == 1,
        "{:?}",
        out.stderr
    );
    ensure!(
        node_names(&c, 0).await? == ["ru1", "ru2"],
        "nothing may change"
    );
    Ok(())
}
