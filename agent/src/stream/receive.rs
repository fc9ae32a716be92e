//! The receive loop's state and one handler per message, as PostgreSQL's
//! `apply_dispatch` has it: `mod.rs` connects and selects between the
//! stream, replies of pipelined transactions and the feedback tick; what
//! each message does to the state is here, one method each.
//!
//! Invariants kept here: transactions are handed to the applier in the
//! publisher's commit order (COMMIT and STREAM COMMIT, as they arrive); a
//! streamed transaction applied while it arrives is given up whenever
//! another transaction could commit before it (`early.rs`); the publisher's
//! watermark takes effect only after what was queued before it.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use mm_proto::Lsn;
use mm_proto::pgoutput::{
    Begin, Commit, Message, Relation, StreamAbort, StreamCommit, StreamStart, StreamTracker,
};
use tracing::{debug, warn};

use super::early::{StreamedEarly, abandon_idle_early, abandon_streamed, apply_early};
use super::spool::Spool;
use super::{
    LocalNode, OpenTxn, Progress, StreamError, announce, apply_err, apply_one, finished, publish,
    send_feedback,
};
use crate::apply::{Applier, InMemory, TxnBody, TxnMeta};
use crate::watermark::{self, Announcement};

pub(super) struct Receiver<'a> {
    pub local: &'a LocalNode,
    pub peer: String,
    pub applier: Applier,
    pub spool: Spool,
    pub tracker: StreamTracker,
    pub progress: Progress,
    /// The ordinary (non-streamed) transaction being received.
    pub current: Option<OpenTxn>,
    /// The streamed transaction whose segment is being received.
    pub stream_xid: Option<u32>,
    /// The streamed transaction applied while it arrives (`early.rs`), and
    /// the publisher's watermark announcement that arrived meanwhile: it
    /// takes effect after that transaction (installing it settles the
    /// session, which holds that transaction open).
    pub streamed_early: Option<StreamedEarly>,
    pub deferred_announcement: Option<Announcement>,
    /// The publisher's WAL flush position when the stream connected
    /// (IDENTIFY_SYSTEM).
    pub publisher_at_start: Lsn,
}

impl Receiver<'_> {
    fn spool_err(&self, source: std::io::Error) -> StreamError {
        StreamError::Spool {
            peer: self.peer.clone(),
            source,
        }
    }

    fn proto_err(&self, lsn: Lsn, message: String) -> StreamError {
        StreamError::Protocol {
            peer: self.peer.clone(),
            lsn,
            message,
        }
    }

    fn behind_to(&self) -> Option<Lsn> {
        publisher_known(
            self.local
                .status
                .get(&self.peer)
                .and_then(|s| s.publisher_lsn),
            self.publisher_at_start,
        )
    }

    /// Sends the transactions held in a group (`apply/group.rs`); a failure
    /// names the transaction it belongs to, not the message that came next.
    async fn send_group(&mut self) -> Result<(), StreamError> {
        self.applier
            .close_group()
            .await
            .map_err(|f| super::apply_err(&self.peer, None, f))
    }

    /// Before the next message: a streamed transaction a conflict or
    /// failure rolled back is applied at its commit, and an announcement
    /// held for it takes effect.
    pub async fn before_next(&mut self) -> Result<(), StreamError> {
        self.applier
            .send_queued()
            .await
            .map_err(|f| super::apply_err(&self.peer, None, f))?;
        if self.streamed_early.is_some() && !self.applier.is_early() {
            self.streamed_early = None;
        }
        if self.streamed_early.is_none()
            && let Some(a) = self.deferred_announcement.take()
        {
            announce(
                &mut self.applier,
                self.local,
                &self.peer,
                &mut self.progress,
                a,
            )
            .await?;
        }
        Ok(())
    }

    /// Every feedback period: early transactions whose publisher fell
    /// silent are given up; feedback and status go out.
    pub async fn on_tick(
        &mut self,
        stream: &mut mm_proto::client::LogicalReplicationStream,
    ) -> Result<(), StreamError> {
        // Not reading (`Applier::wants_more`), the stream cannot tell a
        // silent publisher from a busy apply backend: time spent so does
        // not count as the publisher's silence.
        if !self.applier.wants_more() {
            if let Some(open) = self.current.as_mut() {
                open.last_at = Instant::now();
            }
            if let Some(e) = self.streamed_early.as_mut() {
                e.heard();
            }
        }
        if let Some(open) = self.current.as_mut() {
            abandon_idle_early(&mut self.applier, &self.peer, open).await?;
        }
        stream.set_read_batch(read_batch(self.behind_to(), self.progress.received));
        if self
            .streamed_early
            .as_ref()
            .is_some_and(StreamedEarly::idle)
        {
            warn!(
                xid = self.streamed_early.as_ref().map_or(0, |e| e.xid),
                "the publisher stopped sending a streamed transaction being applied while it arrived: rolled back here, applied at its commit"
            );
            abandon_streamed(
                &mut self.applier,
                &self.peer,
                &mut self.streamed_early,
                "idle",
            )
            .await?;
        }
        let idle = self.current.is_none();
        send_feedback(
            &mut self.applier,
            stream,
            &mut self.progress,
            idle,
            true,
            &self.peer,
        )
        .await?;
        finished(
            &mut self.applier,
            self.local,
            &self.peer,
            &mut self.progress,
        );
        publish(&self.local.status, &self.peer, &self.progress);
        Ok(())
    }

    pub async fn on_keepalive(
        &mut self,
        stream: &mut mm_proto::client::LogicalReplicationStream,
        wal_end: Lsn,
        reply_requested: bool,
    ) -> Result<(), StreamError> {
        self.progress.received = self.progress.received.max(wal_end);
        // Every transaction sent before this keepalive has been received
        // and, when none is open or unanswered, applied.
        if self.current.is_none() && self.stream_xid.is_none() && self.applier.in_flight() == 0 {
            self.progress.processed = self.progress.processed.max(wal_end);
            // Not a claim about commit timestamps: during catch-up a
            // keepalive's send time is "now" while its position is far
            // behind. The publisher's announcements say that
            // (`Announcement::at`).
        }
        if reply_requested {
            let idle = self.current.is_none();
            send_feedback(
                &mut self.applier,
                stream,
                &mut self.progress,
                idle,
                false,
                &self.peer,
            )
            .await?;
        }
        Ok(())
    }

    /// One pgoutput message, dispatched by kind and by where it arrives
    /// (inside a streamed segment, an ordinary transaction, or neither).
    pub async fn on_data(
        &mut self,
        wal_start: Lsn,
        wal_end: Lsn,
        raw: Bytes,
    ) -> Result<(), StreamError> {
        self.progress.received = self.progress.received.max(wal_end);
        let decoded = self
            .tracker
            .decode(raw.clone())
            .map_err(|e| self.proto_err(wal_start, e.to_string()))?;
        match decoded {
            Message::Begin(b) => self.on_begin(wal_start, b).await,
            Message::Commit(c) => self.on_commit(wal_start, c).await,
            Message::StreamStart(s) => self.on_stream_start(s).await,
            Message::StreamStop => {
                self.stream_xid = None;
                Ok(())
            }
            Message::StreamCommit(c) => self.on_stream_commit(c).await,
            Message::StreamAbort(a) => self.on_stream_abort(a).await,
            Message::Relation(r) if self.stream_xid.is_some() => {
                self.on_streamed_relation(wal_start, r, &raw).await
            }
            other if self.stream_xid.is_some() => self.on_streamed_change(other, &raw).await,
            Message::Relation(r) if self.current.is_none() => {
                self.send_group().await?;
                self.applier
                    .relation(r)
                    .await
                    .map_err(|failure| StreamError::Local {
                        peer: self.peer.clone(),
                        failure: Box::new(failure),
                    })
            }
            Message::Message(m) if self.current.is_none() && m.prefix == watermark::PREFIX => {
                self.on_announcement(wal_start, &m.content).await
            }
            Message::Origin(_) | Message::Message(_) | Message::Type(_)
                if self.current.is_none() =>
            {
                Ok(())
            }
            other @ (Message::Relation(_)
            | Message::Type(_)
            | Message::Insert(_)
            | Message::Update(_)
            | Message::Delete(_)
            | Message::Truncate(_)
            | Message::Message(_)
            | Message::Origin(_)) => self.on_change(wal_start, other, raw).await,
            other => Err(self.proto_err(
                wal_start,
                format!("{} was not negotiated (two-phase is off)", other.name()),
            )),
        }
    }

    async fn on_begin(&mut self, wal_start: Lsn, b: Begin) -> Result<(), StreamError> {
        if self.current.is_some() {
            return Err(self.proto_err(wal_start, "BEGIN inside an open transaction".into()));
        }
        // It committed first on the publisher: it must here too.
        abandon_streamed(
            &mut self.applier,
            &self.peer,
            &mut self.streamed_early,
            "a transaction committed before it",
        )
        .await?;
        self.current = Some(OpenTxn::new(b));
        Ok(())
    }

    async fn on_commit(&mut self, wal_start: Lsn, c: Commit) -> Result<(), StreamError> {
        let Some(mut open) = self.current.take() else {
            return Err(self.proto_err(wal_start, "COMMIT without BEGIN".into()));
        };
        let meta = TxnMeta {
            xid: open.begin.xid,
            commit_lsn: c.commit_lsn,
            end_lsn: c.end_lsn,
            commit_ts: c.commit_timestamp,
        };
        let early = open.early.take();
        let body: TxnBody = if open.spilled {
            let spooled = self
                .spool
                .take(open.begin.xid)
                .map_err(|e| self.spool_err(e))?;
            match spooled {
                Some(t) => Arc::new(t),
                None => Arc::new(InMemory(Arc::new(Vec::new()))),
            }
        } else {
            Arc::new(InMemory(Arc::new(open.msgs)))
        };
        match early {
            Some(rest) => self.commit_early(&meta, body, rest).await?,
            None => apply_one(&mut self.applier, &self.peer, &meta, body).await?,
        }
        self.queued(&meta);
        Ok(())
    }

    /// The rest of a transaction applied while it arrived, and its COMMIT.
    async fn commit_early(
        &mut self,
        meta: &TxnMeta,
        body: TxnBody,
        rest: Vec<Message>,
    ) -> Result<(), StreamError> {
        let was = self
            .applier
            .commit_early(meta, body, rest)
            .await
            .map_err(|f| apply_err(&self.peer, Some(meta), f))?;
        if was {
            self.local.status.update(&self.peer, |s| s.early_txns += 1);
        }
        Ok(())
    }

    /// A transaction was handed to the applier.
    fn queued(&mut self, meta: &TxnMeta) {
        self.progress.last_queued = meta.end_lsn;
        finished(
            &mut self.applier,
            self.local,
            &self.peer,
            &mut self.progress,
        );
    }

    async fn on_stream_start(&mut self, s: StreamStart) -> Result<(), StreamError> {
        if self.streamed_early.as_ref().is_some_and(|e| e.xid != s.xid) {
            // It may commit first.
            abandon_streamed(
                &mut self.applier,
                &self.peer,
                &mut self.streamed_early,
                "another streamed transaction",
            )
            .await?;
        }
        if s.first_segment {
            debug!(
                xid = s.xid,
                "streaming an in-progress transaction to the spool"
            );
            if self.streamed_early.is_none()
                && self.current.is_none()
                && self.spool.streams_open() == 0
            {
                self.streamed_early =
                    StreamedEarly::begin(&mut self.applier, &self.peer, s.xid).await?;
            }
        }
        self.stream_xid = Some(s.xid);
        Ok(())
    }

    async fn on_stream_commit(&mut self, c: StreamCommit) -> Result<(), StreamError> {
        let meta = TxnMeta {
            xid: c.xid,
            commit_lsn: c.commit_lsn,
            end_lsn: c.end_lsn,
            commit_ts: c.commit_timestamp,
        };
        let reader = self.spool.take(c.xid).map_err(|e| self.spool_err(e))?;
        // Spool reads are buffered (1 MiB) sequential file reads, mostly
        // from the page cache.
        let body: TxnBody = match reader {
            Some(r) => Arc::new(r),
            None => Arc::new(InMemory(Arc::new(Vec::new()))),
        };
        match self.streamed_early.take_if(|e| e.xid == c.xid) {
            Some(e) => self.commit_early(&meta, body, e.rest()).await?,
            None => apply_one(&mut self.applier, &self.peer, &meta, body).await?,
        }
        self.queued(&meta);
        Ok(())
    }

    async fn on_stream_abort(&mut self, a: StreamAbort) -> Result<(), StreamError> {
        let discarded = self
            .spool
            .abort(a.xid, a.subtransaction_xid)
            .map_err(|e| self.spool_err(e))?;
        // Applied changes of it are gone on the publisher: the spool
        // without them is applied at the commit.
        if self.streamed_early.as_ref().is_some_and(|e| e.xid == a.xid)
            && (discarded || a.xid == a.subtransaction_xid)
        {
            abandon_streamed(
                &mut self.applier,
                &self.peer,
                &mut self.streamed_early,
                "aborted in part",
            )
            .await?;
        }
        Ok(())
    }

    async fn on_streamed_relation(
        &mut self,
        wal_start: Lsn,
        r: Relation,
        raw: &[u8],
    ) -> Result<(), StreamError> {
        // Like PostgreSQL's apply worker: update the relation map now AND
        // keep the message in the spool for replay.
        let xid = self.spool_streamed(r.xid, raw)?;
        // In order with its changes queued so far.
        if let Some(e) = self.streamed_early.as_mut().filter(|e| e.xid == xid) {
            e.push(&mut self.applier, &self.peer, Message::Relation(r.clone()))
                .await?;
            e.flush(&mut self.applier, &self.peer).await?;
            if self.applier.is_early() {
                return Ok(());
            }
        }
        self.send_group().await?;
        self.applier
            .relation(r)
            .await
            .map_err(|failure| StreamError::Apply {
                peer: self.peer.clone(),
                xid,
                lsn: wal_start,
                failure: Box::new(failure),
            })
    }

    /// Appends a message of the streamed segment being received to the
    /// spool, under its subtransaction (`sub`, else the transaction), and
    /// returns the transaction's xid.
    fn spool_streamed(&mut self, sub: Option<u32>, raw: &[u8]) -> Result<u32, StreamError> {
        let xid = self.stream_xid.unwrap_or_default();
        self.spool
            .append(xid, sub.unwrap_or(xid), raw)
            .map_err(|e| self.spool_err(e))?;
        self.local
            .status
            .update(&self.peer, |s| s.streamed_bytes += raw.len() as u64);
        Ok(xid)
    }

    async fn on_streamed_change(&mut self, m: Message, raw: &[u8]) -> Result<(), StreamError> {
        let xid = self.spool_streamed(m.stream_xid(), raw)?;
        if let Some(e) = self.streamed_early.as_mut().filter(|e| e.xid == xid) {
            e.push(&mut self.applier, &self.peer, m).await?;
        }
        Ok(())
    }

    async fn on_announcement(&mut self, wal_start: Lsn, content: &[u8]) -> Result<(), StreamError> {
        match Announcement::decode(content) {
            Ok(a) if a.node == self.peer && self.streamed_early.is_some() => {
                self.deferred_announcement = Some(a);
            }
            Ok(a) if a.node == self.peer => {
                announce(
                    &mut self.applier,
                    self.local,
                    &self.peer,
                    &mut self.progress,
                    a,
                )
                .await?;
            }
            // Relayed or foreign: not this publisher's word.
            Ok(_) => {}
            Err(e) => {
                warn!(lsn = %wal_start, error = %e, "ignoring a malformed watermark")
            }
        }
        Ok(())
    }

    /// A change (or relation, type, origin, message) of the ordinary
    /// transaction being received.
    async fn on_change(
        &mut self,
        wal_start: Lsn,
        m: Message,
        raw: Bytes,
    ) -> Result<(), StreamError> {
        let Some(open) = self.current.as_mut() else {
            return Err(self.proto_err(wal_start, format!("{} outside a transaction", m.name())));
        };
        if let Err(e) = open.push(m, raw, &mut self.spool) {
            return Err(self.spool_err(e));
        }
        apply_early(&mut self.applier, &self.peer, open).await
    }
}

/// Far behind its publisher (a backlog: a pause, a restart, a burst), the
/// stream reads the socket only once `READ_BATCH` bytes are there (or its
/// receive window has closed, or the connection's batch wait passed)
/// instead of per message as they arrive. Draining as fast as the walsender writes
/// woke this process once per message, and with the window always open the
/// walsender sent every message as a segment of its own, on the cores it
/// shares with the apply backend (ARCHITECTURE, "Apply throughput"). Near
/// the end of the backlog reads go back to message by message, so a stream
/// that keeps up sees no added latency.
fn read_batch(publisher: Option<Lsn>, received: Lsn) -> usize {
    match publisher {
        Some(p) if p.0.saturating_sub(received.0) > BATCH_BEHIND => READ_BATCH,
        _ => 0,
    }
}

/// The newest known position of the publisher's WAL: the lag probe's
/// (`lag.rs`, once a second), or where it was when the stream connected
/// if that is newer. A stream resumed after a pause used to see its
/// backlog only at the probe's next sample, which may have been taken
/// before the backlog was written: 200k rows in 1000-row transactions
/// are caught up in under a second, and in a third of such runs the reads
/// went message by message (agent 0.2-0.3 s of CPU instead of 0.1,
/// catch-up 0.8-1.1 s instead of 0.7-0.8).
fn publisher_known(probed: Option<Lsn>, at_start: Lsn) -> Option<Lsn> {
    Some(probed.map_or(at_start, |p| p.max(at_start)))
}

/// Behind by more than this (the publisher's WAL position, probed every
/// second by `lag.rs`), reads are batched.
const BATCH_BEHIND: u64 = 4 << 20;
/// The low-water mark of batched reads: half the receive buffer the
/// connection asks for (`BATCH_RCVBUF` in mm-proto, doubled by the kernel);
/// where `net.core.rmem_max` grants less, above it, and the kernel then
/// wakes the reader when the window closes.
const READ_BATCH: usize = 1 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_that_connects_behind_is_batched_before_the_first_probe() {
        let start = Lsn(0x1_0000_0000);
        let far = Lsn(start.0 + BATCH_BEHIND + 1);
        assert_eq!(read_batch(publisher_known(None, far), start), READ_BATCH);
        // An older probe does not hide what the connection saw, a newer one
        // counts.
        assert_eq!(
            read_batch(publisher_known(Some(start), far), start),
            READ_BATCH
        );
        assert_eq!(
            publisher_known(Some(Lsn(far.0 + 1)), far),
            Some(Lsn(far.0 + 1))
        );
        assert_eq!(read_batch(publisher_known(None, start), start), 0);
    }

    #[test]
    fn reads_are_batched_only_far_behind_a_known_publisher() {
        let received = Lsn(100 << 20);
        assert_eq!(read_batch(None, received), 0, "publisher position unknown");
        assert_eq!(read_batch(Some(received), received), 0, "caught up");
        assert_eq!(
            read_batch(Some(Lsn(received.0 + BATCH_BEHIND)), received),
            0
        );
        assert_eq!(
            read_batch(Some(Lsn(received.0 + BATCH_BEHIND + 1)), received),
            READ_BATCH
        );
        // A probe older than what was received since: not behind.
        assert_eq!(read_batch(Some(Lsn(1)), received), 0);
    }
}
