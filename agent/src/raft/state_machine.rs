//! The Raft state machine: applies committed `ClusterRequest`s to
//! `ClusterState`, persists the result, and publishes it on a watch channel.
//!
//! The state is a few kilobytes, so it is persisted whole after every applied
//! batch (in the same redb file as the log) and a snapshot is simply that state
//! serialized as JSON. Persisting per batch means a restart resumes from the
//! last applied entry instead of replaying the log, and the reconciler sees the
//! real state (e.g. paused pairs) the moment the agent starts, before any
//! leader is reachable.

use std::io::Cursor;
use std::sync::Arc;

use openraft::storage::{RaftStateMachine, Snapshot};
use openraft::{
    BasicNode, EntryPayload, ErrorSubject, ErrorVerb, LogId, OptionalSend, RaftSnapshotBuilder,
    SnapshotMeta, StoredMembership,
};
use redb::Database;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::log_store::{
    Entry, META, StoreError, StoreResult, io_err, put_meta, read_meta, read_meta_raw,
    write_blocking,
};
use super::types::{ClusterResponse, ClusterState, TypeConfig};

const KEY_STATE: &str = "state_machine";
const KEY_SNAPSHOT_META: &str = "snapshot_meta";
const KEY_SNAPSHOT_DATA: &str = "snapshot_data";

type Meta = SnapshotMeta<u64, BasicNode>;

/// Everything the state machine holds; also the snapshot format.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct SmData {
    last_applied: Option<LogId<u64>>,
    last_membership: StoredMembership<u64, BasicNode>,
    cluster: ClusterState,
}

pub struct StateMachine {
    db: Arc<Database>,
    data: SmData,
    tx: watch::Sender<ClusterState>,
}

impl StateMachine {
    /// Loads the persisted state; the returned receiver starts with it.
    pub(super) fn open(
        db: Arc<Database>,
    ) -> Result<(Self, watch::Receiver<ClusterState>), StoreError> {
        let data: SmData = read_meta(&db, KEY_STATE)?.unwrap_or_default();
        let (tx, rx) = watch::channel(data.cluster.clone());
        Ok((Self { db, data, tx }, rx))
    }

    async fn persist(&self, snapshot: Option<(Meta, Vec<u8>)>) -> Result<(), StoreError> {
        let data = self.data.clone();
        write_blocking(&self.db, move |tx| {
            put_meta(tx, KEY_STATE, &data)?;
            if let Some((meta, bytes)) = &snapshot {
                put_meta(tx, KEY_SNAPSHOT_META, meta)?;
                tx.open_table(META)?
                    .insert(KEY_SNAPSHOT_DATA, bytes.as_slice())?;
            }
            Ok(())
        })
        .await
    }

    fn publish(&self) {
        // send_replace: never fails, even with no receiver left.
        self.tx.send_replace(self.data.cluster.clone());
    }
}

impl RaftStateMachine<TypeConfig> for StateMachine {
    type SnapshotBuilder = SnapshotBuilder;

    async fn applied_state(
        &mut self,
    ) -> StoreResult<(Option<LogId<u64>>, StoredMembership<u64, BasicNode>)> {
        Ok((self.data.last_applied, self.data.last_membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> StoreResult<Vec<ClusterResponse>>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut replies = Vec::new();
        for entry in entries {
            self.data.last_applied = Some(entry.log_id);
            self.data.cluster.last_applied_index = entry.log_id.index;
            let reply = match &entry.payload {
                EntryPayload::Blank => ClusterResponse::Ok,
                EntryPayload::Normal(req) => {
                    let r = self.data.cluster.apply(req);
                    if let ClusterResponse::Error(e) = &r {
                        tracing::info!(index = entry.log_id.index, error = %e, "cluster command rejected");
                    }
                    r
                }
                EntryPayload::Membership(m) => {
                    self.data.last_membership =
                        StoredMembership::new(Some(entry.log_id), m.clone());
                    ClusterResponse::Ok
                }
            };
            replies.push(reply);
        }
        if replies.is_empty() {
            return Ok(replies);
        }
        let last = self.data.last_applied;
        self.persist(None).await.map_err(|e| {
            io_err(
                ErrorSubject::Apply(last.unwrap_or_default()),
                ErrorVerb::Write,
                e,
            )
        })?;
        self.publish();
        Ok(replies)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        SnapshotBuilder {
            db: Arc::clone(&self.db),
            data: self.data.clone(),
        }
    }

    async fn begin_receiving_snapshot(&mut self) -> StoreResult<Box<Cursor<Vec<u8>>>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &Meta,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> StoreResult<()> {
        let bytes = snapshot.into_inner();
        let subject = || ErrorSubject::Snapshot(Some(meta.signature()));
        let mut data: SmData = serde_json::from_slice(&bytes)
            .map_err(|e| io_err(subject(), ErrorVerb::Read, e.into()))?;
        // The metadata is authoritative for what the snapshot covers.
        data.last_applied = meta.last_log_id;
        data.last_membership = meta.last_membership.clone();
        data.cluster.last_applied_index = meta.last_log_id.map(|l| l.index).unwrap_or(0);
        self.data = data;
        self.persist(Some((meta.clone(), bytes)))
            .await
            .map_err(|e| io_err(subject(), ErrorVerb::Write, e))?;
        self.publish();
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> StoreResult<Option<Snapshot<TypeConfig>>> {
        let read = || -> Result<Option<Snapshot<TypeConfig>>, StoreError> {
            let Some(meta) = read_meta::<Meta>(&self.db, KEY_SNAPSHOT_META)? else {
                return Ok(None);
            };
            let bytes = read_meta_raw(&self.db, KEY_SNAPSHOT_DATA)?.unwrap_or_default();
            Ok(Some(Snapshot {
                meta,
                snapshot: Box::new(Cursor::new(bytes)),
            }))
        };
        read().map_err(|e| io_err(ErrorSubject::Snapshot(None), ErrorVerb::Read, e))
    }
}

/// Builds a snapshot of the state as it was when the builder was taken.
pub struct SnapshotBuilder {
    db: Arc<Database>,
    data: SmData,
}

impl RaftSnapshotBuilder<TypeConfig> for SnapshotBuilder {
    async fn build_snapshot(&mut self) -> StoreResult<Snapshot<TypeConfig>> {
        let bytes = serde_json::to_vec(&self.data)
            .map_err(|e| io_err(ErrorSubject::Snapshot(None), ErrorVerb::Write, e.into()))?;
        let index = self.data.last_applied.map(|l| l.index).unwrap_or(0);
        let meta = Meta {
            last_log_id: self.data.last_applied,
            last_membership: self.data.last_membership.clone(),
            snapshot_id: format!("{index}-{}", uuid::Uuid::new_v4().simple()),
        };
        let (m, b) = (meta.clone(), bytes.clone());
        write_blocking(&self.db, move |tx| {
            put_meta(tx, KEY_SNAPSHOT_META, &m)?;
            tx.open_table(META)?
                .insert(KEY_SNAPSHOT_DATA, b.as_slice())?;
            Ok(())
        })
        .await
        .map_err(|e| {
            io_err(
                ErrorSubject::Snapshot(Some(meta.signature())),
                ErrorVerb::Write,
                e,
            )
        })?;
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(bytes)),
        })
    }
}
