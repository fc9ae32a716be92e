//! The replicated state machine's data: what Raft agrees on, and the commands
//! that change it. Pure data and pure functions, no I/O.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Cursor;

use mm_proto::api::{NodeInfo, NodeState};
use serde::{Deserialize, Serialize};

openraft::declare_raft_types!(
    /// openraft's type configuration for the mm control plane.
    pub TypeConfig:
        D = ClusterRequest,
        R = ClusterResponse,
        NodeId = u64,
        Node = openraft::BasicNode,
        SnapshotData = Cursor<Vec<u8>>,
);

/// A command proposed to the Raft log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClusterRequest {
    AddNode(NodeInfo),
    /// Adds a node that gets its data from `source` (add-node with data):
    /// recorded `syncing`, so no stream into it starts until its copy is
    /// done (`sync`), while its own writes already stream out.
    AddSyncingNode {
        node: NodeInfo,
        source: String,
    },
    SetNodeState {
        name: String,
        state: NodeState,
    },
    RemoveNode {
        name: String,
    },
    SetPaused {
        from: String,
        to: String,
        paused: bool,
    },
    /// Makes a sequence cluster-global (`mmctl sequence add`): values from
    /// `start` up to `max` are handed out in chunks of `chunk`.
    AddSequence {
        name: String,
        chunk: i64,
        start: i64,
        max: i64,
    },
    /// Hands node `node` the next chunk of `sequence` (its agent refills
    /// before it runs out). `known`: how many chunks of this node the agent
    /// knew of when it asked, so a retried request (its answer lost) does
    /// not take a second one.
    AllocateRange {
        sequence: String,
        node: String,
        known: usize,
    },
}

/// A cluster-global sequence: the allocator's state. Invariant (enforced in
/// `apply`): chunks are handed out in increasing order from `next` and
/// never again, so no two nodes (and no node twice) ever get the same
/// value, whatever happens to the nodes that held them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GlobalSequence {
    pub chunk: i64,
    /// The first value not handed out yet.
    pub next: i64,
    /// The sequence type's (or its MAXVALUE's) largest value.
    pub max: i64,
    /// Every chunk ever handed out, in order.
    pub ranges: Vec<SequenceRange>,
    /// The last chunk reached `max`.
    #[serde(default)]
    pub exhausted: bool,
}

/// Values `start..=end` of a global sequence, given to `node`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SequenceRange {
    pub node: String,
    pub start: i64,
    pub end: i64,
}

/// The outcome of applying one command. A rejected command is a committed log
/// entry that changed nothing: validation happens in `apply`, on every node
/// identically, so it can only depend on the replicated state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClusterResponse {
    Ok,
    Error(String),
}

/// Everything the control plane agrees on.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterState {
    /// Index of the last log entry applied (including blank and membership entries).
    pub last_applied_index: u64,
    pub nodes: BTreeMap<u64, NodeInfo>,
    /// Ids of removed nodes. Invariant (enforced in `apply`): an id in this set
    /// is never accepted again, so a stale agent that was removed cannot come
    /// back under its old identity and be mistaken for a current member.
    pub removed_ids: BTreeSet<u64>,
    /// Names of removed nodes (until a node of that name joins again): every
    /// node drops their slots and origins on sight (`cluster.rs`), also ones
    /// a removed agent that missed its removal creates again.
    #[serde(default)]
    pub removed_names: BTreeSet<String>,
    /// (from, to) node names whose stream is paused. Lives in Raft so a pause
    /// survives agent restarts until `resume`.
    pub paused: BTreeSet<(String, String)>,
    /// Global sequences by schema-qualified name.
    #[serde(default)]
    pub sequences: BTreeMap<String, GlobalSequence>,
    /// Per node being added with data: the node it copies from.
    #[serde(default)]
    pub sync_sources: BTreeMap<String, String>,
}

/// Node names become parts of slot and origin names (`mm_<from>_to_<to>`),
/// so they are restricted to what is safe and unambiguous there.
pub fn is_valid_node_name(name: &str) -> bool {
    (1..=32).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

impl ClusterState {
    pub fn node_by_name(&self, name: &str) -> Option<&NodeInfo> {
        self.nodes.values().find(|n| n.name == name)
    }

    pub fn is_paused(&self, from: &str, to: &str) -> bool {
        self.paused.contains(&(from.to_owned(), to.to_owned()))
    }

    /// Applies one command. Never fails and never panics: an invalid command is
    /// answered with `ClusterResponse::Error` and leaves the state unchanged.
    pub fn apply(&mut self, req: &ClusterRequest) -> ClusterResponse {
        match self.try_apply(req) {
            Ok(()) => ClusterResponse::Ok,
            Err(e) => ClusterResponse::Error(e),
        }
    }

    fn try_apply(&mut self, req: &ClusterRequest) -> Result<(), String> {
        match req {
            ClusterRequest::AddSyncingNode { node, source } => {
                match self.node_by_name(source) {
                    Some(s) if s.state == NodeState::Active => {}
                    Some(s) => {
                        return Err(format!(
                            "source node {source} is {}, not active: it cannot be copied from",
                            s.state
                        ));
                    }
                    None => return Err(format!("unknown source node {source}")),
                }
                let node = NodeInfo {
                    state: NodeState::Syncing,
                    ..node.clone()
                };
                self.try_apply(&ClusterRequest::AddNode(node.clone()))?;
                self.sync_sources.insert(node.name, source.clone());
                Ok(())
            }
            ClusterRequest::AddNode(info) => {
                if !is_valid_node_name(&info.name) {
                    return Err(format!(
                        "invalid node name {:?}: expected 1-32 characters of [a-z0-9_-]",
                        info.name
                    ));
                }
                if info.id == 0 {
                    return Err(format!("node {} has id 0, which is reserved", info.name));
                }
                if self.removed_ids.contains(&info.id) {
                    return Err(format!(
                        "node id {} was removed from the cluster and cannot be reused \
                         (wipe the agent's data_dir to give it a new id)",
                        info.id
                    ));
                }
                if let Some(existing) = self.nodes.get(&info.id) {
                    return Err(format!(
                        "node id {} is already used by node {}",
                        info.id, existing.name
                    ));
                }
                if let Some(existing) = self.node_by_name(&info.name) {
                    return Err(format!(
                        "a node named {} already exists (id {})",
                        info.name, existing.id
                    ));
                }
                self.removed_names.remove(&info.name);
                self.nodes.insert(info.id, info.clone());
                Ok(())
            }
            ClusterRequest::SetNodeState { name, state } => {
                let node = self
                    .nodes
                    .values_mut()
                    .find(|n| &n.name == name)
                    .ok_or_else(|| format!("unknown node {name}"))?;
                node.state = *state;
                if *state == NodeState::Active {
                    self.sync_sources.remove(name);
                }
                Ok(())
            }
            ClusterRequest::RemoveNode { name } => {
                let id = self
                    .node_by_name(name)
                    .map(|n| n.id)
                    .ok_or_else(|| format!("unknown node {name}"))?;
                self.nodes.remove(&id);
                self.sync_sources.remove(name);
                self.removed_ids.insert(id);
                self.removed_names.insert(name.clone());
                self.paused.retain(|(from, to)| from != name && to != name);
                Ok(())
            }
            ClusterRequest::AddSequence {
                name,
                chunk,
                start,
                max,
            } => {
                if *chunk < 1 {
                    return Err(format!(
                        "sequence {name}: --chunk must be at least 1, not {chunk}"
                    ));
                }
                if start > max {
                    return Err(format!(
                        "sequence {name}: its values are used up to its maximum {max}; nothing is left to hand out"
                    ));
                }
                if let Some(g) = self.sequences.get(name) {
                    // Repeating the same command is not an error.
                    if g.chunk == *chunk {
                        return Ok(());
                    }
                    return Err(format!(
                        "sequence {name} is already global (chunk {})",
                        g.chunk
                    ));
                }
                self.sequences.insert(
                    name.clone(),
                    GlobalSequence {
                        chunk: *chunk,
                        next: *start,
                        max: *max,
                        ranges: Vec::new(),
                        exhausted: false,
                    },
                );
                Ok(())
            }
            ClusterRequest::AllocateRange {
                sequence,
                node,
                known,
            } => {
                if self.node_by_name(node).is_none() {
                    return Err(format!("unknown node {node}"));
                }
                let g = self
                    .sequences
                    .get_mut(sequence)
                    .ok_or_else(|| format!("sequence {sequence} is not global"))?;
                let held = g.ranges.iter().filter(|r| &r.node == node).count();
                // The agent counts its unused chunks; a chunk it asked for
                // before (a retry after a lost answer) is not given twice.
                if held > *known {
                    return Ok(());
                }
                if g.exhausted || g.next > g.max {
                    return Err(format!(
                        "sequence {sequence} is exhausted (maximum {})",
                        g.max
                    ));
                }
                let end = g.next.saturating_add(g.chunk - 1).min(g.max);
                g.ranges.push(SequenceRange {
                    node: node.clone(),
                    start: g.next,
                    end,
                });
                match end.checked_add(1) {
                    Some(n) if end < g.max => g.next = n,
                    _ => g.exhausted = true,
                }
                Ok(())
            }
            ClusterRequest::SetPaused { from, to, paused } => {
                if from == to {
                    return Err(format!("cannot pause node {from}'s stream into itself"));
                }
                for n in [from, to] {
                    if self.node_by_name(n).is_none() {
                        return Err(format!("unknown node {n}"));
                    }
                }
                let key = (from.clone(), to.clone());
                if *paused {
                    self.paused.insert(key);
                } else {
                    self.paused.remove(&key);
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;

    fn node(id: u64, name: &str) -> NodeInfo {
        NodeInfo {
            id,
            name: name.into(),
            api_url: format!("http://127.0.0.1:{}", 7600 + id),
            peer_dsn: format!("host=127.0.0.1 port={} user=mm", 5400 + id),
            state: NodeState::Active,
        }
    }

    fn two_nodes() -> ClusterState {
        let mut s = ClusterState::default();
        assert_eq!(
            s.apply(&ClusterRequest::AddNode(node(1, "n1"))),
            ClusterResponse::Ok
        );
        assert_eq!(
            s.apply(&ClusterRequest::AddNode(node(2, "n2"))),
            ClusterResponse::Ok
        );
        s
    }

    fn is_err(r: &ClusterResponse, needle: &str) -> bool {
        matches!(r, ClusterResponse::Error(e) if e.contains(needle))
    }

    #[test]
    fn add_node_rejects_duplicates_and_bad_input_without_changing_state() {
        let mut s = two_nodes();
        let before = s.clone();
        let r = s.apply(&ClusterRequest::AddNode(node(3, "n1")));
        assert!(is_err(&r, "named n1 already exists"), "{r:?}");
        let r = s.apply(&ClusterRequest::AddNode(node(2, "n3")));
        assert!(is_err(&r, "already used by node n2"), "{r:?}");
        let r = s.apply(&ClusterRequest::AddNode(node(0, "n3")));
        assert!(is_err(&r, "id 0"), "{r:?}");
        let r = s.apply(&ClusterRequest::AddNode(node(3, "N3!")));
        assert!(is_err(&r, "invalid node name"), "{r:?}");
        let r = s.apply(&ClusterRequest::AddNode(node(3, &"x".repeat(33))));
        assert!(is_err(&r, "invalid node name"), "{r:?}");
        assert_eq!(s, before);
    }

    #[test]
    fn removed_ids_are_never_reused() {
        let mut s = two_nodes();
        assert_eq!(
            s.apply(&ClusterRequest::RemoveNode { name: "n2".into() }),
            ClusterResponse::Ok
        );
        assert!(s.removed_ids.contains(&2));
        assert!(s.removed_names.contains("n2"));
        assert!(s.node_by_name("n2").is_none());
        let r = s.apply(&ClusterRequest::AddNode(node(2, "n2")));
        assert!(is_err(&r, "cannot be reused"), "{r:?}");
        // The name itself may come back under a fresh id.
        assert_eq!(
            s.apply(&ClusterRequest::AddNode(node(7, "n2"))),
            ClusterResponse::Ok
        );
        assert!(!s.removed_names.contains("n2"), "a member again");
    }

    #[test]
    fn unknown_nodes_are_rejected() {
        let mut s = two_nodes();
        let before = s.clone();
        let r = s.apply(&ClusterRequest::SetNodeState {
            name: "n9".into(),
            state: NodeState::Parting,
        });
        assert!(is_err(&r, "unknown node n9"), "{r:?}");
        let r = s.apply(&ClusterRequest::RemoveNode { name: "n9".into() });
        assert!(is_err(&r, "unknown node n9"), "{r:?}");
        let r = s.apply(&ClusterRequest::SetPaused {
            from: "n1".into(),
            to: "n9".into(),
            paused: true,
        });
        assert!(is_err(&r, "unknown node n9"), "{r:?}");
        assert_eq!(s, before);
    }

    #[test]
    fn set_node_state_changes_only_that_node() {
        let mut s = two_nodes();
        let r = s.apply(&ClusterRequest::SetNodeState {
            name: "n2".into(),
            state: NodeState::Joining,
        });
        assert_eq!(r, ClusterResponse::Ok);
        assert_eq!(s.nodes[&2].state, NodeState::Joining);
        assert_eq!(s.nodes[&1].state, NodeState::Active);
    }

    #[test]
    fn pause_resume_and_removal_clear_pairs() {
        let mut s = two_nodes();
        let pause = |from: &str, to: &str, paused| ClusterRequest::SetPaused {
            from: from.into(),
            to: to.into(),
            paused,
        };
        let r = s.apply(&pause("n1", "n1", true));
        assert!(is_err(&r, "into itself"), "{r:?}");
        assert_eq!(s.apply(&pause("n1", "n2", true)), ClusterResponse::Ok);
        assert!(s.is_paused("n1", "n2"));
        assert!(!s.is_paused("n2", "n1"), "pause is directional");
        // Idempotent.
        assert_eq!(s.apply(&pause("n1", "n2", true)), ClusterResponse::Ok);
        assert_eq!(s.paused.len(), 1);
        assert_eq!(s.apply(&pause("n1", "n2", false)), ClusterResponse::Ok);
        assert!(!s.is_paused("n1", "n2"));
        assert_eq!(s.apply(&pause("n2", "n1", true)), ClusterResponse::Ok);
        assert_eq!(
            s.apply(&ClusterRequest::RemoveNode { name: "n2".into() }),
            ClusterResponse::Ok
        );
        assert!(
            s.paused.is_empty(),
            "pairs of a removed node must not linger"
        );
    }

    #[test]
    fn sequence_chunks_are_disjoint_never_reused_and_retries_take_none() {
        let mut s = two_nodes();
        let add = ClusterRequest::AddSequence {
            name: "public.s".into(),
            chunk: 10,
            start: 101,
            max: 135,
        };
        assert_eq!(s.apply(&add), ClusterResponse::Ok);
        assert_eq!(s.apply(&add), ClusterResponse::Ok, "repeating it is fine");
        let r = s.apply(&ClusterRequest::AddSequence {
            name: "public.s".into(),
            chunk: 5,
            start: 1,
            max: 135,
        });
        assert!(is_err(&r, "already global"), "{r:?}");
        let alloc = |node: &str, known| ClusterRequest::AllocateRange {
            sequence: "public.s".into(),
            node: node.into(),
            known,
        };
        assert_eq!(s.apply(&alloc("n1", 0)), ClusterResponse::Ok);
        // A retry of the same request (the answer was lost): nothing new.
        assert_eq!(s.apply(&alloc("n1", 0)), ClusterResponse::Ok);
        assert_eq!(s.apply(&alloc("n2", 0)), ClusterResponse::Ok);
        assert_eq!(s.apply(&alloc("n1", 1)), ClusterResponse::Ok);
        assert_eq!(s.apply(&alloc("n2", 1)), ClusterResponse::Ok);
        let g = &s.sequences["public.s"];
        let got: Vec<(&str, i64, i64)> = g
            .ranges
            .iter()
            .map(|r| (r.node.as_str(), r.start, r.end))
            .collect();
        assert_eq!(
            got,
            vec![
                ("n1", 101, 110),
                ("n2", 111, 120),
                ("n1", 121, 130),
                ("n2", 131, 135)
            ],
            "the last chunk stops at the maximum"
        );
        let r = s.apply(&alloc("n1", 2));
        assert!(is_err(&r, "exhausted"), "{r:?}");
        let r = s.apply(&alloc("n9", 0));
        assert!(is_err(&r, "unknown node n9"), "{r:?}");
        // A removed node's chunks stay taken: a new node gets fresh ones.
        s.apply(&ClusterRequest::RemoveNode { name: "n2".into() });
        assert_eq!(s.sequences["public.s"].ranges.len(), 4);
    }

    #[test]
    fn a_sequence_used_up_to_its_maximum_is_refused() {
        let mut s = two_nodes();
        let r = s.apply(&ClusterRequest::AddSequence {
            name: "public.small".into(),
            chunk: 10,
            start: 32768,
            max: 32767,
        });
        assert!(is_err(&r, "used up"), "{r:?}");
        let r = s.apply(&ClusterRequest::AddSequence {
            name: "public.small".into(),
            chunk: 0,
            start: 1,
            max: 32767,
        });
        assert!(is_err(&r, "at least 1"), "{r:?}");
        assert!(s.sequences.is_empty());
    }

    #[test]
    fn state_round_trips_through_json() {
        let mut s = two_nodes();
        s.apply(&ClusterRequest::SetPaused {
            from: "n2".into(),
            to: "n1".into(),
            paused: true,
        });
        s.removed_ids.insert(9);
        s.last_applied_index = 42;
        let json = serde_json::to_string(&s).unwrap();
        assert!(json.contains(r#""state":"active""#), "{json}");
        let back: ClusterState = serde_json::from_str(&json).unwrap();
        assert_eq!(back, s);
    }
}
