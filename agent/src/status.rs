//! Live state of the streams into this node, shared by the stream tasks (writers)
//! and the API, `/metrics` and `wait-sync` (readers).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use mm_proto::api::{StreamState, StreamStatus};
use tokio::sync::Notify;

/// `tombstones` before the data plane has counted them.
const NOT_COUNTED: u64 = u64::MAX;

/// One entry per publisher node streaming into this node, keyed by its name.
/// A plain mutex: updates are a few per transaction and never held across awaits.
#[derive(Debug)]
pub struct StatusRegistry {
    local: String,
    streams: Mutex<BTreeMap<String, StreamStatus>>,
    /// Rows in the local `mm.tombstones`; `NOT_COUNTED` until set.
    tombstones: AtomicU64,
    /// Per publisher: wakes the stream's supervisor out of its backoff sleep
    /// (`mmctl skip` stored a request the stream reads when it restarts).
    kicks: Mutex<BTreeMap<String, Arc<Notify>>>,
}

impl Default for StatusRegistry {
    fn default() -> Self {
        Self::new("")
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl StatusRegistry {
    pub fn new(local_node: &str) -> Self {
        Self {
            local: local_node.to_owned(),
            streams: Mutex::new(BTreeMap::new()),
            tombstones: AtomicU64::new(NOT_COUNTED),
            kicks: Mutex::new(BTreeMap::new()),
        }
    }

    pub fn local_node(&self) -> &str {
        &self.local
    }

    pub fn snapshot(&self) -> Vec<StreamStatus> {
        lock(&self.streams).values().cloned().collect()
    }

    /// The status of the stream from `from` (the registry is keyed by it):
    /// a copy of that one, not of every stream's.
    pub fn get(&self, from: &str) -> Option<StreamStatus> {
        lock(&self.streams).get(from).cloned()
    }

    /// Applies `f` to the status of the stream from `from`, creating it if needed.
    pub fn update(&self, from: &str, f: impl FnOnce(&mut StreamStatus)) {
        let mut g = lock(&self.streams);
        let entry = g.entry(from.to_owned()).or_insert_with(|| StreamStatus {
            from: from.to_owned(),
            to: self.local.clone(),
            state: StreamState::Starting,
            last_error: None,
            received_lsn: None,
            applied_lsn: None,
            processed_lsn: None,
            lag_bytes: None,
            lag_seconds: None,
            applied_txns: 0,
            applied_rows: 0,
            conflicts: BTreeMap::new(),
            routine: 0,
            restarts: 0,
            streamed_bytes: 0,
            early_txns: 0,
            conflict_rollbacks: 0,
            conflicts_in_place: 0,
            error_kind: None,
            stuck_lsn: None,
            stuck_commit_ts: None,
            publisher_lsn: None,
        });
        f(entry);
    }

    pub fn remove(&self, from: &str) {
        lock(&self.streams).remove(from);
    }

    /// Records the number of rows in the local `mm.tombstones` (shown in
    /// status and as the `mm_tombstones` gauge).
    pub fn set_tombstones(&self, n: u64) {
        self.tombstones
            .store(n.min(NOT_COUNTED - 1), Ordering::Relaxed);
    }

    /// The last count given to `set_tombstones`, None before the first.
    pub fn tombstones(&self) -> Option<u64> {
        match self.tombstones.load(Ordering::Relaxed) {
            NOT_COUNTED => None,
            n => Some(n),
        }
    }

    /// The signal that cuts the backoff of the stream from `from` short.
    /// The stream's supervisor waits on it; `kick` fires it.
    pub fn kick_signal(&self, from: &str) -> Arc<Notify> {
        Arc::clone(lock(&self.kicks).entry(from.to_owned()).or_default())
    }

    /// Asks the stream from `from` to restart now instead of after its
    /// backoff. A stream that is running when kicked keeps running; if it
    /// then fails, it retries at once (the kick is remembered, once).
    pub fn kick(&self, from: &str) {
        self.kick_signal(from).notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn tombstones_are_unknown_until_counted() {
        let r = StatusRegistry::new("n1");
        assert_eq!(r.tombstones(), None);
        r.set_tombstones(0);
        assert_eq!(r.tombstones(), Some(0));
        r.set_tombstones(42);
        assert_eq!(r.tombstones(), Some(42));
    }

    #[tokio::test]
    async fn a_kick_before_the_wait_is_remembered_once() {
        let r = StatusRegistry::new("n1");
        let signal = r.kick_signal("n2");
        r.kick("n2");
        let first = tokio::time::timeout(Duration::from_millis(500), signal.notified()).await;
        assert!(first.is_ok(), "the pending kick was lost");
        let second = tokio::time::timeout(Duration::from_millis(100), signal.notified()).await;
        assert!(second.is_err(), "one kick woke the stream twice");
        // Another stream's kick does not wake this one.
        r.kick("n3");
        let other = tokio::time::timeout(Duration::from_millis(100), signal.notified()).await;
        assert!(other.is_err(), "n3's kick woke the stream from n2");
    }
}
