//! Keeps one stream running: restarts it after errors with exponential
//! backoff, so a stream failing on the same transaction retries slowly instead
//! of spinning, and reports its last error in the status registry. A kick
//! (`StatusRegistry::kick`, sent by `mmctl skip`) cuts the backoff short: the
//! stream restarts at once and reads the new skip request.

use std::sync::Arc;
use std::time::{Duration, Instant};

use mm_proto::api::StreamState;
use tokio::sync::{Notify, watch};
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
        let kick = status.kick_signal(&p.name);
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
                let kind = e.kind();
                let stuck = e.stuck_at();
                status.update(&p.name, |s| {
                    s.state = StreamState::Error;
                    s.last_error = Some(msg);
                    s.error_kind = Some(kind);
                    s.stuck_lsn = stuck.map(|(l, _)| l);
                    s.stuck_commit_ts = stuck.and_then(|(_, t)| t);
                    s.restarts += 1;
                });
            }
            if started.elapsed() > HEALTHY_AFTER {
                backoff = BACKOFF_START;
            }
            let Some(woke) = pause(backoff, &kick, &mut stop_rx).await else {
                break;
            };
            if woke == Wake::Kicked {
                info!(from = %p.name, to = %local.name, "restarting stream now (kicked, e.g. by mmctl skip)");
            } else {
                backoff = (backoff * 2).min(BACKOFF_MAX);
                info!(from = %p.name, to = %local.name, "restarting stream");
            }
        }
    });
    StreamHandle {
        peer,
        stop: stop_tx,
        task,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wake {
    BackoffOver,
    Kicked,
}

/// The pause between two runs: the backoff, cut short by a kick. None when
/// the stream is being stopped.
async fn pause(
    backoff: Duration,
    kick: &Notify,
    stop_rx: &mut watch::Receiver<bool>,
) -> Option<Wake> {
    tokio::select! {
        _ = tokio::time::sleep(backoff) => Some(Wake::BackoffOver),
        _ = kick.notified() => Some(Wake::Kicked),
        _ = stop_rx.changed() => None,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;
    use crate::status::StatusRegistry;

    #[tokio::test]
    async fn a_kick_cuts_the_backoff_short_and_stop_ends_it() {
        let status = Arc::new(StatusRegistry::new("me"));
        let kick = status.kick_signal("p1");
        let (stop_tx, mut stop_rx) = watch::channel(false);

        // Unkicked: the whole backoff.
        let t = Instant::now();
        let w = pause(Duration::from_millis(300), &kick, &mut stop_rx).await;
        assert_eq!(w, Some(Wake::BackoffOver));
        assert!(t.elapsed() >= Duration::from_millis(300));

        // Kicked during a long backoff (as the skip route does): at once.
        let st = Arc::clone(&status);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            st.kick("p1");
        });
        let t = Instant::now();
        let w = pause(Duration::from_secs(30), &kick, &mut stop_rx).await;
        assert_eq!(w, Some(Wake::Kicked));
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());

        // A kick while the stream was running is kept for the next pause.
        status.kick("p1");
        let w = tokio::time::timeout(
            Duration::from_secs(5),
            pause(Duration::from_secs(30), &kick, &mut stop_rx),
        )
        .await;
        assert_eq!(w.ok(), Some(Some(Wake::Kicked)));

        // Another stream's kick does not wake this one.
        status.kick("p2");
        let w = pause(Duration::from_millis(200), &kick, &mut stop_rx).await;
        assert_eq!(w, Some(Wake::BackoffOver));

        // Stopping ends the pause.
        stop_tx.send(true).unwrap();
        let w = tokio::time::timeout(
            Duration::from_secs(5),
            pause(Duration::from_secs(30), &kick, &mut stop_rx),
        )
        .await;
        assert_eq!(w.ok(), Some(None));
    }
}
