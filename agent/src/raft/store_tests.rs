//! openraft's storage conformance suite against the redb store, plus the
//! durability properties the suite does not cover (reopen from disk).

#![allow(clippy::unwrap_used)] // tests may unwrap

use std::sync::Arc;

use mm_proto::api::{NodeInfo, NodeState};
use openraft::storage::{RaftLogStorage, RaftStateMachine};
use openraft::testing::{StoreBuilder, Suite};
use openraft::{Entry, EntryPayload, LogId, RaftLogReader, StorageError, Vote};
use tempfile::TempDir;

use super::log_store::{LogStore, open_db};
use super::state_machine::StateMachine;
use super::types::{ClusterRequest, TypeConfig};
use super::{STORE_FILE, load_or_create_node_id};

struct Builder;

impl StoreBuilder<TypeConfig, LogStore, StateMachine, TempDir> for Builder {
    async fn build(&self) -> Result<(TempDir, LogStore, StateMachine), StorageError<u64>> {
        let dir = tempfile::tempdir().unwrap();
        let db = open_db(&dir.path().join(STORE_FILE)).unwrap();
        let (sm, _rx) = StateMachine::open(Arc::clone(&db)).unwrap();
        Ok((dir, LogStore::new(db), sm))
    }
}

#[test]
fn openraft_storage_suite() {
    Suite::test_all(Builder).unwrap();
}

fn log_id(term: u64, index: u64) -> LogId<u64> {
    LogId::new(openraft::CommittedLeaderId::new(term, 1), index)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vote_committed_and_state_survive_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(STORE_FILE);
    let node = NodeInfo {
        id: 5,
        name: "n5".into(),
        api_url: "http://127.0.0.1:1".into(),
        peer_dsn: "host=127.0.0.1".into(),
        state: NodeState::Active,
    };
    {
        let db = open_db(&path).unwrap();
        let mut log = LogStore::new(Arc::clone(&db));
        let (mut sm, _rx) = StateMachine::open(db).unwrap();
        log.save_vote(&Vote::new(3, 5)).await.unwrap();
        log.save_committed(Some(log_id(3, 1))).await.unwrap();
        let entry = Entry::<TypeConfig> {
            log_id: log_id(3, 1),
            payload: EntryPayload::Normal(ClusterRequest::AddNode(node.clone())),
        };
        sm.apply([entry]).await.unwrap();
    }
    let db = open_db(&path).unwrap();
    let mut log = LogStore::new(Arc::clone(&db));
    assert_eq!(log.read_vote().await.unwrap(), Some(Vote::new(3, 5)));
    assert_eq!(log.read_committed().await.unwrap(), Some(log_id(3, 1)));
    assert!(log.try_get_log_entries(0..10).await.unwrap().is_empty());
    let (mut sm, rx) = StateMachine::open(db).unwrap();
    assert_eq!(sm.applied_state().await.unwrap().0, Some(log_id(3, 1)));
    let state = rx.borrow().clone();
    assert_eq!(state.nodes.get(&5), Some(&node));
    assert_eq!(state.last_applied_index, 1);
}

#[test]
fn node_id_is_created_once_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let sub = dir.path().join("data");
    let id = load_or_create_node_id(&sub).unwrap();
    assert_ne!(id, 0);
    assert!(id < 1 << 53);
    assert_eq!(load_or_create_node_id(&sub).unwrap(), id);
    std::fs::write(sub.join(super::NODE_ID_FILE), "garbage\n").unwrap();
    let err = load_or_create_node_id(&sub).unwrap_err().to_string();
    assert!(err.contains("corrupt"), "{err}");
}
