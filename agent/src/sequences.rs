//! Global sequences on this node (SPEC §4 `mmctl sequence`, DESIGN "Global
//! sequences"). Raft hands out disjoint chunks (`raft::types`,
//! `AllocateRange`); this task keeps the local sequence inside one of this
//! node's chunks and always one more chunk in reserve, so a refill never
//! waits on Raft: when half of the current chunk is left it switches
//! the sequence to the reserve (`ALTER SEQUENCE … MINVALUE/MAXVALUE/RESTART`)
//! and asks for the next reserve at once. Without a Raft quorum the
//! reserve still carries a node through one more chunk.
//!
//! Invariant (no value twice, cluster-wide): the local sequence only ever
//! draws from chunks Raft gave this node, each taken once (a chunk is
//! entered only if it lies wholly above everything the sequence handed out
//! before), and Raft never gives a value twice.
//!
//! Sizing: a chunk must last longer than one tick plus an ALTER, at the
//! node's peak insert rate (e.g. 5,000 inserts/s and the 50 ms tick: half
//! a chunk of at least 500 with room for a slow ALTER, so `--chunk` 2,000
//! or more); otherwise
//! `nextval` reaches the chunk's end and fails until the switch.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mm_proto::api::SequenceAllocateRequest;
use tokio::sync::watch;
use tokio_postgres::Client;
use tracing::{info, warn};

use crate::raft::types::{ClusterState, GlobalSequence, SequenceRange};

/// Half a chunk is the headroom: values wasted at every switch (half a
/// chunk) buy time against a busy node; measured in CI, a quarter of a
/// 100-value chunk ran out at ~200 inserts/s under load.
const TICK: Duration = Duration::from_millis(50);
const WARN_EVERY: Duration = Duration::from_secs(10);

/// The local sequence's settings and position (`pg_sequences`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalSequence {
    /// None until `nextval` is called after a (re)start.
    pub last_value: Option<i64>,
    pub min_value: i64,
    pub max_value: i64,
    pub increment: i64,
}

/// `schema.name` split; None when not schema-qualified.
/// Values of `g` not handed out to any node yet.
pub fn values_left(g: &GlobalSequence) -> i64 {
    if g.exhausted {
        return 0;
    }
    g.max.saturating_sub(g.next).saturating_add(1).max(0)
}

/// Fewer than eight chunks left: reported (status, log, metric) while
/// every node still has its chunks and reserves to insert from.
pub fn running_out(g: &GlobalSequence) -> bool {
    g.exhausted || values_left(g) < g.chunk.saturating_mul(8)
}

/// The global sequences as `mmctl status` shows them: what is left, and
/// each node's two newest chunks (in use and reserve).
pub fn status(state: &ClusterState) -> Vec<mm_proto::api::SequenceStatus> {
    state
        .sequences
        .iter()
        .map(|(name, g)| {
            let mut ranges = Vec::new();
            for n in state.nodes.values() {
                let mine: Vec<&SequenceRange> =
                    g.ranges.iter().filter(|r| r.node == n.name).collect();
                for r in &mine[mine.len().saturating_sub(2)..] {
                    ranges.push(mm_proto::api::SequenceRangeInfo {
                        node: r.node.clone(),
                        start: r.start,
                        end: r.end,
                    });
                }
            }
            mm_proto::api::SequenceStatus {
                name: name.clone(),
                chunk: g.chunk,
                max: g.max,
                left: values_left(g),
                running_out: running_out(g),
                exhausted: g.exhausted,
                ranges,
            }
        })
        .collect()
}

pub fn split_name(name: &str) -> Option<(&str, &str)> {
    let (schema, seq) = name.split_once('.')?;
    (!schema.is_empty() && !seq.is_empty() && !seq.contains('.')).then_some((schema, seq))
}

/// `"schema"."name"`, for DDL.
pub fn quoted(name: &str) -> Option<String> {
    let (schema, seq) = split_name(name)?;
    Some(crate::apply::sql::qualified(schema, seq))
}

pub async fn read_local(
    client: &Client,
    name: &str,
) -> Result<Option<LocalSequence>, tokio_postgres::Error> {
    let Some((schema, seq)) = split_name(name) else {
        return Ok(None);
    };
    let row = client
        .query_opt(
            "SELECT last_value, min_value, max_value, increment_by FROM pg_catalog.pg_sequences \
             WHERE schemaname = $1 AND sequencename = $2",
            &[&schema, &seq],
        )
        .await?;
    Ok(match row {
        None => None,
        Some(r) => Some(LocalSequence {
            last_value: r.try_get(0)?,
            min_value: r.try_get(1)?,
            max_value: r.try_get(2)?,
            increment: r.try_get(3)?,
        }),
    })
}

/// The largest value of the column the sequence belongs to (serial,
/// identity), if any: rows replicated from other nodes count too.
pub async fn owner_max(client: &Client, name: &str) -> Result<Option<i64>, tokio_postgres::Error> {
    let Some(q) = quoted(name) else {
        return Ok(None);
    };
    let owner = client
        .query_opt(
            "SELECT d.refobjid::regclass::text, a.attname::text FROM pg_catalog.pg_depend d \
             JOIN pg_catalog.pg_attribute a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid \
             WHERE d.classid = 'pg_catalog.pg_class'::regclass AND d.objid = $1::text::regclass \
               AND d.refclassid = 'pg_catalog.pg_class'::regclass AND d.deptype IN ('a', 'i')",
            &[&q],
        )
        .await?;
    let Some(owner) = owner else {
        return Ok(None);
    };
    let table: String = owner.try_get(0)?;
    let column: String = owner.try_get(1)?;
    let row = client
        .query_one(
            &format!(
                "SELECT max({})::int8 FROM {table}",
                crate::apply::sql::quote_ident(&column)
            ),
            &[],
        )
        .await?;
    row.try_get(0)
}

/// What to do about one sequence now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Nothing,
    /// Ask Raft for another chunk (`known`: chunks of ours we know of).
    Allocate {
        known: usize,
    },
    /// Move the local sequence into this chunk.
    Switch(SequenceRange),
}

/// The chunk the local sequence is in, if it is in one of ours.
pub fn current<'a>(
    g: &'a GlobalSequence,
    node: &str,
    l: &LocalSequence,
) -> Option<&'a SequenceRange> {
    g.ranges
        .iter()
        .find(|r| r.node == node && r.start == l.min_value && r.end == l.max_value)
}

/// The decision, a pure function of the allocator's state and the local
/// sequence (unit-tested below).
pub fn step(g: &GlobalSequence, node: &str, l: &LocalSequence) -> Step {
    let mine: Vec<&SequenceRange> = g.ranges.iter().filter(|r| r.node == node).collect();
    let known = mine.len();
    let Some(i) = mine
        .iter()
        .position(|r| r.start == l.min_value && r.end == l.max_value)
    else {
        // Not in one of ours yet: enter the first chunk wholly above what
        // the sequence handed out so far.
        let used = l.last_value.unwrap_or(i64::MIN);
        return match mine.iter().find(|r| r.start > used) {
            Some(r) => Step::Switch((*r).clone()),
            None => Step::Allocate { known },
        };
    };
    let cur = mine[i];
    let Some(reserve) = mine.get(i + 1) else {
        return Step::Allocate { known };
    };
    let size = cur.end - cur.start + 1;
    let left = cur.end - l.last_value.unwrap_or(cur.start - 1);
    if left <= (size / 2).max(1) {
        Step::Switch((*reserve).clone())
    } else {
        Step::Nothing
    }
}

/// Moves the local sequence into `r`. Values already handed out stay
/// handed out; sessions with cached values of the old chunk use them up
/// (they are ours).
async fn switch(client: &Client, name: &str, r: &SequenceRange) -> Result<(), String> {
    let q = quoted(name).ok_or_else(|| format!("{name} is not schema-qualified"))?;
    client
        .batch_execute(&format!(
            "ALTER SEQUENCE {q} NO CYCLE MINVALUE {s} MAXVALUE {e} START WITH {s} RESTART WITH {s}",
            s = r.start,
            e = r.end
        ))
        .await
        .map_err(|e| e.to_string())
}

pub struct Manager {
    pub node: String,
    pub dsn: String,
    pub password: Option<String>,
    pub api_url: String,
    pub token: Arc<str>,
}

impl Manager {
    pub async fn run(self, mut cluster: watch::Receiver<ClusterState>) {
        let http = match crate::ctl::client::AgentClient::new(self.token.to_string()) {
            Ok(c) => c,
            Err(e) => {
                warn!(error = %e, "global sequences: no HTTP client; not managing sequences");
                return;
            }
        };
        let mut warned: BTreeMap<String, Instant> = BTreeMap::new();
        let mut client: Option<Client> = None;
        loop {
            tokio::time::sleep(TICK).await;
            let state = cluster.borrow_and_update().clone();
            if state.sequences.is_empty() || state.node_by_name(&self.node).is_none() {
                continue;
            }
            if client.is_none() {
                match crate::pg::connect(&self.dsn, self.password.as_deref()).await {
                    Ok(c) => client = Some(c),
                    Err(e) => {
                        self.warn(&mut warned, "connect", &format!("local PostgreSQL: {e}"));
                        continue;
                    }
                }
            }
            let Some(c) = client.as_ref() else { continue };
            for (name, g) in &state.sequences {
                let local = match read_local(c, name).await {
                    Ok(Some(l)) => l,
                    Ok(None) => {
                        self.warn(
                            &mut warned,
                            name,
                            &format!("global sequence {name} does not exist on this node"),
                        );
                        continue;
                    }
                    Err(e) => {
                        self.warn(&mut warned, name, &format!("reading {name}: {e}"));
                        client = None;
                        break;
                    }
                };
                match step(g, &self.node, &local) {
                    Step::Nothing => {}
                    Step::Switch(r) => match switch(c, name, &r).await {
                        Ok(()) => {
                            info!(sequence = %name, start = r.start, end = r.end, "global sequence switched to its next chunk")
                        }
                        Err(e) => self.warn(
                            &mut warned,
                            name,
                            &format!("switching {name} to {}..{}: {e}", r.start, r.end),
                        ),
                    },
                    Step::Allocate { known } => {
                        let req = SequenceAllocateRequest {
                            sequence: name.clone(),
                            node: self.node.clone(),
                            known,
                        };
                        let r: Result<serde_json::Value, _> = http
                            .post(&self.api_url, "/v1/sequences/allocate", &req, None)
                            .await;
                        if let Err(e) = r {
                            self.warn(&mut warned, name, &format!("no new chunk of {name}: {e}"));
                        }
                    }
                }
                if running_out(g) {
                    self.warn(
                        &mut warned,
                        &format!("{name}/left"),
                        &format!(
                            "global sequence {name} is running out: {} values left to hand out (maximum {})",
                            values_left(g),
                            g.max
                        ),
                    );
                }
            }
        }
    }

    /// Warns about `key` at most every 10 s.
    fn warn(&self, warned: &mut BTreeMap<String, Instant>, key: &str, msg: &str) {
        let now = Instant::now();
        if warned
            .get(key)
            .is_some_and(|t| now.duration_since(*t) < WARN_EVERY)
        {
            return;
        }
        warned.insert(key.to_owned(), now);
        warn!(node = %self.node, "{msg}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(ranges: &[(&str, i64, i64)]) -> GlobalSequence {
        GlobalSequence {
            chunk: 100,
            next: 1000,
            max: i64::MAX,
            exhausted: false,
            ranges: ranges
                .iter()
                .map(|&(n, s, e)| SequenceRange {
                    node: n.into(),
                    start: s,
                    end: e,
                })
                .collect(),
        }
    }

    fn local(last: Option<i64>, min: i64, max: i64) -> LocalSequence {
        LocalSequence {
            last_value: last,
            min_value: min,
            max_value: max,
            increment: 1,
        }
    }

    #[test]
    fn a_fresh_node_asks_then_enters_its_first_chunk_above_what_it_used() {
        let none = g(&[("b", 101, 200)]);
        assert_eq!(
            step(&none, "a", &local(Some(7), 1, 2147483647)),
            Step::Allocate { known: 0 }
        );
        let some = g(&[("a", 1, 100), ("b", 101, 200), ("a", 201, 300)]);
        // It already handed out 150 (before the sequence became global):
        // the first chunk is below that and is skipped.
        match step(&some, "a", &local(Some(150), 1, 2147483647)) {
            Step::Switch(r) => assert_eq!((r.start, r.end), (201, 300)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn keeps_a_reserve_and_switches_with_half_left() {
        let one = g(&[("a", 1, 100)]);
        assert_eq!(
            step(&one, "a", &local(Some(10), 1, 100)),
            Step::Allocate { known: 1 }
        );
        let two = g(&[("a", 1, 100), ("b", 101, 200), ("a", 201, 300)]);
        assert_eq!(step(&two, "a", &local(Some(49), 1, 100)), Step::Nothing);
        match step(&two, "a", &local(Some(50), 1, 100)) {
            Step::Switch(r) => assert_eq!(r.start, 201),
            other => panic!("{other:?}"),
        }
        // Just switched (RESTART: no value yet): the next reserve is asked.
        assert_eq!(
            step(&two, "a", &local(None, 201, 300)),
            Step::Allocate { known: 2 }
        );
    }

    #[test]
    fn names_must_be_schema_qualified() {
        assert_eq!(split_name("public.s"), Some(("public", "s")));
        assert_eq!(split_name("s"), None);
        assert_eq!(split_name(".s"), None);
        assert_eq!(split_name("a.b.c"), None);
        assert_eq!(
            quoted("public.My Seq").as_deref(),
            Some("\"public\".\"My Seq\"")
        );
    }
}
