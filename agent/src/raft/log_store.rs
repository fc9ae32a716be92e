//! Raft log, vote, committed and last-purged ids in one redb file (`raft.redb`).
//!
//! Why redb in the agent's data_dir and not PostgreSQL: restoring or PITR-ing
//! the database must never roll the vote or the log back (that breaks Raft's
//! safety), and Raft must keep working while the local database is down.
//! Every write transaction is committed with redb's default durability
//! (fsync before `commit` returns), so "saved" means "on disk".

use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::Arc;

use openraft::storage::{LogFlushed, LogState, RaftLogStorage};
use openraft::{
    AnyError, ErrorSubject, ErrorVerb, LogId, OptionalSend, RaftLogReader, StorageError,
    StorageIOError, Vote,
};
use redb::{Database, ReadableTable, TableDefinition};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::types::TypeConfig;

pub(super) type Entry = openraft::Entry<TypeConfig>;
pub(super) type StoreResult<T> = Result<T, StorageError<u64>>;

/// Log entries by index, each serialized as JSON.
const LOGS: TableDefinition<u64, &[u8]> = TableDefinition::new("raft_log");
/// Small named values: "vote", "committed", "last_purged" (log side) and
/// "state_machine", "snapshot_meta", "snapshot_data" (state machine side).
pub(super) const META: TableDefinition<&str, &[u8]> = TableDefinition::new("raft_meta");

const KEY_VOTE: &str = "vote";
const KEY_COMMITTED: &str = "committed";
const KEY_LAST_PURGED: &str = "last_purged";

/// What can go wrong below openraft; converted to openraft's `StorageError`
/// (which stops the Raft node) at the trait boundary.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("raft store: {0}{hint}", hint = lock_hint(.0))]
    Db(Box<redb::Error>),
    #[error("raft store: corrupt or unreadable record: {0}")]
    Json(#[from] serde_json::Error),
    #[error("raft store: background write task failed: {0}")]
    Join(String),
}

fn lock_hint(e: &redb::Error) -> &'static str {
    if matches!(e, redb::Error::DatabaseAlreadyOpen) {
        " (is another mm-agent running with this data_dir?)"
    } else {
        ""
    }
}

impl StoreError {
    pub(super) fn is_already_open(&self) -> bool {
        matches!(self, StoreError::Db(e) if matches!(**e, redb::Error::DatabaseAlreadyOpen))
    }
}

macro_rules! from_redb {
    ($($t:ty),*) => {$(
        impl From<$t> for StoreError {
            fn from(e: $t) -> Self {
                StoreError::Db(Box::new(e.into()))
            }
        }
    )*};
}
from_redb!(
    redb::Error,
    redb::TransactionError,
    redb::TableError,
    redb::StorageError,
    redb::CommitError,
    redb::DatabaseError
);

pub(super) fn io_err(
    subject: ErrorSubject<u64>,
    verb: ErrorVerb,
    e: StoreError,
) -> StorageError<u64> {
    StorageIOError::new(subject, verb, AnyError::new(&e)).into()
}

/// Opens (creating if needed) the store and its tables. redb takes an
/// exclusive lock on the file, so a second agent on the same data_dir fails here.
pub(super) fn open_db(path: &Path) -> Result<Arc<Database>, StoreError> {
    let db = Database::create(path)?;
    let tx = db.begin_write()?;
    {
        tx.open_table(LOGS)?;
        tx.open_table(META)?;
    }
    tx.commit()?;
    Ok(Arc::new(db))
}

pub(super) fn read_meta<T: DeserializeOwned>(
    db: &Database,
    key: &str,
) -> Result<Option<T>, StoreError> {
    let tx = db.begin_read()?;
    let table = tx.open_table(META)?;
    match table.get(key)? {
        Some(v) => Ok(Some(serde_json::from_slice(v.value())?)),
        None => Ok(None),
    }
}

pub(super) fn read_meta_raw(db: &Database, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
    let tx = db.begin_read()?;
    let table = tx.open_table(META)?;
    Ok(table.get(key)?.map(|v| v.value().to_vec()))
}

/// Runs a write transaction on tokio's blocking pool: a commit waits for
/// fsync, which must not stall the runtime's worker threads (they also carry
/// the data plane and the Raft heartbeats).
pub(super) async fn write_blocking<T, F>(db: &Arc<Database>, f: F) -> Result<T, StoreError>
where
    T: Send + 'static,
    F: FnOnce(&redb::WriteTransaction) -> Result<T, StoreError> + Send + 'static,
{
    let db = Arc::clone(db);
    tokio::task::spawn_blocking(move || {
        let tx = db.begin_write()?;
        let out = f(&tx)?;
        tx.commit()?;
        Ok(out)
    })
    .await
    .map_err(|e| StoreError::Join(e.to_string()))?
}

pub(super) fn put_meta<T: Serialize>(
    tx: &redb::WriteTransaction,
    key: &str,
    value: &T,
) -> Result<(), StoreError> {
    let bytes = serde_json::to_vec(value)?;
    tx.open_table(META)?.insert(key, bytes.as_slice())?;
    Ok(())
}

/// openraft's log storage (storage-v2). Cheap to clone: clones share the database.
#[derive(Clone)]
pub struct LogStore {
    db: Arc<Database>,
}

impl LogStore {
    pub(super) fn new(db: Arc<Database>) -> Self {
        Self { db }
    }

    fn read_range(&self, range: (Bound<u64>, Bound<u64>)) -> Result<Vec<Entry>, StoreError> {
        let tx = self.db.begin_read()?;
        let table = tx.open_table(LOGS)?;
        let mut out = Vec::new();
        for item in table.range::<u64>(range)? {
            let (_, v) = item?;
            out.push(serde_json::from_slice(v.value())?);
        }
        Ok(out)
    }

    fn log_state(&self) -> Result<LogState<TypeConfig>, StoreError> {
        let last_purged: Option<LogId<u64>> = read_meta(&self.db, KEY_LAST_PURGED)?;
        let tx = self.db.begin_read()?;
        let table = tx.open_table(LOGS)?;
        let last = match table.last()? {
            Some((_, v)) => {
                let e: Entry = serde_json::from_slice(v.value())?;
                Some(e.log_id)
            }
            None => last_purged,
        };
        Ok(LogState {
            last_purged_log_id: last_purged,
            last_log_id: last,
        })
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> StoreResult<Vec<Entry>> {
        let bounds = (range.start_bound().cloned(), range.end_bound().cloned());
        self.read_range(bounds)
            .map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Read, e))
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> StoreResult<LogState<TypeConfig>> {
        self.log_state()
            .map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Read, e))
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<u64>) -> StoreResult<()> {
        let vote = *vote;
        write_blocking(&self.db, move |tx| put_meta(tx, KEY_VOTE, &vote))
            .await
            .map_err(|e| io_err(ErrorSubject::Vote, ErrorVerb::Write, e))
    }

    async fn read_vote(&mut self) -> StoreResult<Option<Vote<u64>>> {
        read_meta(&self.db, KEY_VOTE).map_err(|e| io_err(ErrorSubject::Vote, ErrorVerb::Read, e))
    }

    /// Persisting the committed id lets a restarted node re-apply committed
    /// entries at once, before it hears from a leader.
    async fn save_committed(&mut self, committed: Option<LogId<u64>>) -> StoreResult<()> {
        write_blocking(&self.db, move |tx| put_meta(tx, KEY_COMMITTED, &committed))
            .await
            .map_err(|e| io_err(ErrorSubject::Store, ErrorVerb::Write, e))
    }

    async fn read_committed(&mut self) -> StoreResult<Option<LogId<u64>>> {
        read_meta::<Option<LogId<u64>>>(&self.db, KEY_COMMITTED)
            .map(Option::flatten)
            .map_err(|e| io_err(ErrorSubject::Store, ErrorVerb::Read, e))
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<TypeConfig>) -> StoreResult<()>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut rows = Vec::new();
        for e in entries {
            let bytes = serde_json::to_vec(&e)
                .map_err(|err| io_err(ErrorSubject::Logs, ErrorVerb::Write, err.into()))?;
            rows.push((e.log_id.index, bytes));
        }
        let res = write_blocking(&self.db, move |tx| {
            let mut table = tx.open_table(LOGS)?;
            for (index, bytes) in &rows {
                table.insert(*index, bytes.as_slice())?;
            }
            Ok(())
        })
        .await;
        match res {
            Ok(()) => {
                // The commit above returned only after fsync: the entries are durable.
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(e) => {
                callback.log_io_completed(Err(std::io::Error::other(e.to_string())));
                Err(io_err(ErrorSubject::Logs, ErrorVerb::Write, e))
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId<u64>) -> StoreResult<()> {
        let from = log_id.index;
        write_blocking(&self.db, move |tx| {
            let mut table = tx.open_table(LOGS)?;
            table.retain_in::<u64, _>(from.., |_, _| false)?;
            Ok(())
        })
        .await
        .map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Delete, e))
    }

    async fn purge(&mut self, log_id: LogId<u64>) -> StoreResult<()> {
        write_blocking(&self.db, move |tx| {
            // Recorded in the same transaction as the deletion, so the log state
            // never claims entries that are gone or forgets that they are.
            put_meta(tx, KEY_LAST_PURGED, &log_id)?;
            let mut table = tx.open_table(LOGS)?;
            table.retain_in::<u64, _>(..=log_id.index, |_, _| false)?;
            Ok(())
        })
        .await
        .map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Delete, e))
    }
}
