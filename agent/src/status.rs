//! Live state of the streams into this node, shared by the stream tasks (writers)
//! and the API, `/metrics` and `wait-sync` (readers).

use std::collections::BTreeMap;
use std::sync::Mutex;

use mm_proto::api::{StreamState, StreamStatus};

/// One entry per publisher node streaming into this node, keyed by its name.
/// A plain mutex: updates are a few per transaction and never held across awaits.
#[derive(Debug, Default)]
pub struct StatusRegistry {
    local: String,
    streams: Mutex<BTreeMap<String, StreamStatus>>,
}

impl StatusRegistry {
    pub fn new(local_node: &str) -> Self {
        Self {
            local: local_node.to_owned(),
            streams: Mutex::new(BTreeMap::new()),
        }
    }

    pub fn local_node(&self) -> &str {
        &self.local
    }

    pub fn snapshot(&self) -> Vec<StreamStatus> {
        match self.streams.lock() {
            Ok(g) => g.values().cloned().collect(),
            Err(p) => p.into_inner().values().cloned().collect(),
        }
    }

    pub fn get(&self, from: &str) -> Option<StreamStatus> {
        self.snapshot().into_iter().find(|s| s.from == from)
    }

    /// Applies `f` to the status of the stream from `from`, creating it if needed.
    pub fn update(&self, from: &str, f: impl FnOnce(&mut StreamStatus)) {
        let mut g = match self.streams.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
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
            restarts: 0,
            streamed_bytes: 0,
        });
        f(entry);
    }

    pub fn remove(&self, from: &str) {
        let mut g = match self.streams.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        g.remove(from);
    }
}
