//! The durability gate: which applied remote position may be reported to
//! the publisher as flushed. Pure, so its rule is tested on its own.
//!
//! Invariant (durability-gated feedback): a remote position is reported
//! only once the local WAL is flushed past the insert position sampled
//! after the local commit of the transaction that ends there. The
//! publisher may then recycle its WAL up to it; if the local commit were
//! not yet on disk, a crash here would lose a transaction nobody can send
//! again. This is PostgreSQL's own `get_flush_position` rule, at the
//! granularity of the feedback tick.

use std::collections::VecDeque;

use mm_proto::Lsn;

#[derive(Debug, Default)]
pub(super) struct DurabilityGate {
    /// (remote position applied, local WAL insert position sampled after
    /// its commit), oldest first.
    unflushed: VecDeque<(Lsn, Lsn)>,
    durable: Lsn,
}

impl DurabilityGate {
    /// One sample, taken after everything applied so far committed:
    /// `applied` is the end of the last remote transaction committed here,
    /// `insert` and `flush` the local WAL positions read together. Returns
    /// the highest remote position now known durable (never lower than
    /// before).
    pub fn observe(&mut self, applied: Lsn, insert: Lsn, flush: Lsn) -> Lsn {
        if self.unflushed.back().is_none_or(|(r, _)| *r < applied) && applied > self.durable {
            self.unflushed.push_back((applied, insert));
        }
        while let Some(&(remote, local)) = self.unflushed.front() {
            if local > flush {
                break;
            }
            self.durable = self.durable.max(remote);
            self.unflushed.pop_front();
        }
        self.durable
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_position_is_durable_only_once_local_wal_is_flushed_past_its_sample() {
        let mut g = DurabilityGate::default();
        // Applied up to 100 remote; local insert position 5000, flushed 4000.
        assert_eq!(g.observe(Lsn(100), Lsn(5000), Lsn(4000)), Lsn(0));
        // Flush reaches the sample: 100 is durable.
        assert_eq!(g.observe(Lsn(100), Lsn(5000), Lsn(5000)), Lsn(100));
    }

    #[test]
    fn later_positions_wait_for_their_own_sample() {
        let mut g = DurabilityGate::default();
        assert_eq!(g.observe(Lsn(100), Lsn(5000), Lsn(0)), Lsn(0));
        assert_eq!(g.observe(Lsn(200), Lsn(6000), Lsn(5500)), Lsn(100));
        // 300's sample is 7000: flushed to 6500 covers 200 only.
        assert_eq!(g.observe(Lsn(300), Lsn(7000), Lsn(6500)), Lsn(200));
        assert_eq!(g.observe(Lsn(300), Lsn(7100), Lsn(7000)), Lsn(300));
    }

    #[test]
    fn it_never_goes_back() {
        let mut g = DurabilityGate::default();
        assert_eq!(g.observe(Lsn(100), Lsn(5000), Lsn(5000)), Lsn(100));
        // A lower flush reading (another sample's) does not undo it, and
        // nothing newly applied adds nothing.
        assert_eq!(g.observe(Lsn(100), Lsn(9000), Lsn(10)), Lsn(100));
        assert_eq!(g.observe(Lsn(50), Lsn(9000), Lsn(9000)), Lsn(100));
    }

    #[test]
    fn the_first_sample_of_a_position_is_the_one_that_counts() {
        let mut g = DurabilityGate::default();
        assert_eq!(g.observe(Lsn(100), Lsn(5000), Lsn(0)), Lsn(0));
        // The same position sampled again later (higher insert position)
        // does not push its requirement out.
        assert_eq!(g.observe(Lsn(100), Lsn(8000), Lsn(5000)), Lsn(100));
    }
}
