//! The stream's side of applying a transaction while it arrives
//! (`apply/early.rs` has the invariants): when to begin, when to queue the
//! next part, when to give up.
//!
//! Two kinds: a large transaction sent whole after its commit (`OpenTxn`),
//! and a transaction the publisher streams before its commit
//! (`StreamedEarly`). A streamed one is begun at its first segment when no
//! other streamed transaction is open; it is given up (rolled back here,
//! applied from the spool at its STREAM COMMIT) as soon as anything must
//! commit before it (another transaction's BEGIN or segment), a
//! subtransaction of it aborts, or its publisher falls silent.

use std::time::{Duration, Instant};

use mm_proto::pgoutput::Message;
use tracing::{debug, warn};

use super::{OpenTxn, StreamError, apply_err};
use crate::apply::{Applier, TxnMeta};

/// A transaction this big (bytes of messages, below `SPILL_AT` so its
/// first messages are still in memory) is applied while it arrives, in
/// parts of `EARLY_PART` messages: smaller ones gain nothing from it, and
/// many of them are single rows that go out as one statement at COMMIT.
pub(super) const EARLY_AT: usize = 256 << 10;
const EARLY_PART: usize = 2000;

/// A transaction applied while it arrives whose publisher sent nothing for
/// this long is rolled back here and applied at its COMMIT instead: it
/// holds the node's apply gate and its rows' locks while it waits.
const EARLY_IDLE: Duration = Duration::from_secs(2);

pub(super) async fn abandon_idle_early(
    applier: &mut Applier,
    peer: &str,
    open: &mut OpenTxn,
) -> Result<(), StreamError> {
    if open.early.is_none() || open.last_at.elapsed() < EARLY_IDLE {
        return Ok(());
    }
    warn!(xid = open.begin.xid, commit_lsn = %open.begin.final_lsn,
        "the publisher stopped sending a transaction being applied while it arrived: rolled back here, applied at its COMMIT");
    open.early = None;
    open.early_declined = true;
    applier
        .abandon_early()
        .await
        .map_err(|f| apply_err(peer, None, f))
}

/// Begins applying `open` before its COMMIT once it is big enough
/// (`apply/early.rs`), then queues each further part.
pub(super) async fn apply_early(
    applier: &mut Applier,
    peer: &str,
    open: &mut OpenTxn,
) -> Result<(), StreamError> {
    // Called for every change received: the common answers first.
    match &open.early {
        None if open.early_declined || open.spilled || open.bytes < EARLY_AT => return Ok(()),
        Some(part) if part.len() < EARLY_PART => return Ok(()),
        _ => {}
    }
    let meta = TxnMeta {
        xid: open.begin.xid,
        commit_lsn: open.begin.final_lsn,
        // Not known before COMMIT; what failures name until then.
        end_lsn: open.begin.final_lsn,
        commit_ts: open.begin.commit_timestamp,
    };
    let err = |f| apply_err(peer, Some(&meta), f);
    let part = match open.early.as_mut() {
        None => {
            if !applier.begin_early(&meta).await.map_err(err)? {
                open.early_declined = true;
                return Ok(());
            }
            debug!(xid = meta.xid, commit_lsn = %meta.commit_lsn, "applying a large transaction while it arrives");
            open.early = Some(Vec::new());
            open.last_at = Instant::now();
            open.msgs.clone()
        }
        Some(part) => std::mem::take(part),
    };
    applier.queue_early(part).await.map_err(err)
}

/// The streamed transaction being applied while it arrives.
pub(super) struct StreamedEarly {
    pub(super) xid: u32,
    /// Changes received since the last part was queued.
    part: Vec<Message>,
    last_at: Instant,
}

impl StreamedEarly {
    /// At the first segment of streamed transaction `xid`: begins applying
    /// it, unless the applier declines (right after conflicts).
    pub(super) async fn begin(
        applier: &mut Applier,
        peer: &str,
        xid: u32,
    ) -> Result<Option<StreamedEarly>, StreamError> {
        if !applier
            .begin_early(&TxnMeta::streaming(xid))
            .await
            .map_err(|f| apply_err(peer, None, f))?
        {
            return Ok(None);
        }
        debug!(xid, "applying a streamed transaction while it arrives");
        Ok(Some(StreamedEarly {
            xid,
            part: Vec::new(),
            last_at: Instant::now(),
        }))
    }

    /// One more change of it; a full part is queued.
    pub(super) async fn push(
        &mut self,
        applier: &mut Applier,
        peer: &str,
        m: Message,
    ) -> Result<(), StreamError> {
        self.last_at = Instant::now();
        self.part.push(m);
        if self.part.len() >= EARLY_PART {
            self.flush(applier, peer).await?;
        }
        Ok(())
    }

    /// Queues what it received since the last part.
    pub(super) async fn flush(
        &mut self,
        applier: &mut Applier,
        peer: &str,
    ) -> Result<(), StreamError> {
        applier
            .queue_early(std::mem::take(&mut self.part))
            .await
            .map_err(|f| apply_err(peer, None, f))
    }

    /// At its STREAM COMMIT: the changes not queued yet.
    pub(super) fn rest(self) -> Vec<Message> {
        self.part
    }

    pub(super) fn idle(&self) -> bool {
        self.last_at.elapsed() >= EARLY_IDLE
    }

    /// Restarts the idle clock (the stream was not reading).
    pub(super) fn heard(&mut self) {
        self.last_at = Instant::now();
    }
}

/// Gives up applying the streamed transaction while it arrives: rolled back
/// here, applied from the spool at its STREAM COMMIT.
pub(super) async fn abandon_streamed(
    applier: &mut Applier,
    peer: &str,
    early: &mut Option<StreamedEarly>,
    why: &str,
) -> Result<(), StreamError> {
    let Some(e) = early.take() else {
        return Ok(());
    };
    debug!(
        xid = e.xid,
        why, "no longer applying a streamed transaction while it arrives"
    );
    applier
        .abandon_early()
        .await
        .map_err(|f| apply_err(peer, None, f))
}
