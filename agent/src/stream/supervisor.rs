//! Keeps one stream running: restarts it after errors with exponential
//! backoff, so a stream failing on the same transaction retries slowly instead
//! of spinning, and reports its last error in the status registry.

use std::sync::Arc;
use std::time::{Duration, Instant};

use mm_proto::api::StreamState;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{error, info};

use super::{LocalNode, Peer, run};

const BACKOFF_START: Duration = Duration::from_millis(500);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A stream that ran this long without failing is considered healthy again.
const HEALTHY_AFTER: Duration = Duration::from_secs(60);

pub struct StreamHandle {
    pub peer: Peer,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl StreamHandle {
    /// Stops the stream and waits for it: dropping the in-flight apply rolls
    /// back its local transaction, which is safe (the origin progress rolls
    /// back with it and the publisher re-sends).
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

pub fn spawn_stream(local: LocalNode, peer: Peer) -> StreamHandle {
    let (stop_tx, mut stop_rx) = watch::channel(false);
    let p = peer.clone();
    let task = tokio::spawn(async move {
        let status = Arc::clone(&local.status);
        let mut backoff = BACKOFF_START;
        loop {
            status.update(&p.name, |s| s.state = StreamState::Starting);
            let started = Instant::now();
            let result = tokio::select! {
                r = run(&local, &p) => r,
                _ = stop_rx.changed() => break,
            };
            if let Err(e) = result {
                error!(from = %p.name, to = %local.name, error = %e, "stream stopped");
                let msg = e.to_string();
                status.update(&p.name, |s| {
                    s.state = StreamState::Error;
                    s.last_error = Some(msg);
                    s.restarts += 1;
                });
            }
            if started.elapsed() > HEALTHY_AFTER {
                backoff = BACKOFF_START;
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = stop_rx.changed() => break,
            }
            backoff = (backoff * 2).min(BACKOFF_MAX);
            info!(from = %p.name, to = %local.name, "restarting stream");
        }
    });
    StreamHandle {
        peer,
        stop: stop_tx,
        task,
    }
}
