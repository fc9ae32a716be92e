//! Which apply lane a transaction goes to (`lanes.rs`), by its write set.
//! Pure: no I/O, unit-tested below.
//!
//! A write set is a list of fingerprints (`hot::fingerprint`): the replica
//! identity key of every row a transaction changes (old and new) and every
//! unique-index value of the rows it writes. Two transactions that share a
//! fingerprint may depend on each other (one deletes a key the other
//! inserts, both update one row, one frees a unique value the other
//! takes), so the later one goes to the lane of the earlier one, where one
//! session applies them in order. Transactions whose writes are disjoint
//! go to different lanes and run at once. A transaction that shares keys
//! with transactions in two lanes waits until one of them committed.
//! Tables whose writes cannot be fingerprinted (triggers that fire on
//! apply, foreign keys, unique indexes over expressions ...) never get
//! here: `lanes.rs` applies those transactions alone.
//!
//! Invariant (order of dependent transactions): a transaction is placed in
//! a lane only when every uncommitted transaction it shares a key with is
//! in that lane, i.e. queued before it on the same session.

use std::collections::{HashMap, VecDeque};

use mm_proto::Lsn;

/// Where a transaction goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// It shares keys with uncommitted transactions in this lane: there.
    Lane(usize),
    /// It shares none: anywhere; this lane is the least loaded.
    Free(usize),
    /// It shares keys with uncommitted transactions in more than one lane:
    /// place it again once some of them committed.
    Wait,
}

pub struct Scheduler {
    lanes: usize,
    /// Fingerprint -> (end LSN, lane) of the last uncommitted transaction
    /// that wrote it.
    writers: HashMap<u64, (Lsn, usize)>,
    /// Per lane, its uncommitted transactions in order, with their keys.
    queued: Vec<VecDeque<(Lsn, Vec<u64>)>>,
    /// Where the search for the least loaded lane starts: rotates, so
    /// independent transactions spread over every lane.
    next: usize,
}

impl Scheduler {
    pub fn new(lanes: usize) -> Scheduler {
        let lanes = lanes.max(1);
        Scheduler {
            lanes,
            writers: HashMap::new(),
            queued: (0..lanes).map(|_| VecDeque::new()).collect(),
            next: 0,
        }
    }

    /// Every transaction ending at or before `committed` has committed
    /// (commits follow the publisher's order, so one end says it all).
    pub fn retire(&mut self, committed: Lsn) {
        for lane in &mut self.queued {
            while lane.front().is_some_and(|(end, _)| *end <= committed) {
                if let Some((end, keys)) = lane.pop_front() {
                    for k in keys {
                        if self.writers.get(&k).is_some_and(|(e, _)| *e == end) {
                            self.writers.remove(&k);
                        }
                    }
                }
            }
        }
    }

    /// Where a transaction writing `keys` can go now.
    pub fn place(&self, keys: &[u64]) -> Placement {
        let mut dep = None;
        for k in keys {
            if let Some((_, lane)) = self.writers.get(k) {
                match dep {
                    None => dep = Some(*lane),
                    Some(d) if d == *lane => {}
                    Some(_) => return Placement::Wait,
                }
            }
        }
        if let Some(d) = dep {
            return Placement::Lane(d);
        }
        let least = (0..self.lanes)
            .map(|i| (self.next + i) % self.lanes)
            .min_by_key(|l| self.queued[*l].len())
            .unwrap_or(0);
        Placement::Free(least)
    }

    /// Records that the transaction ending at `end` went to `lane`.
    pub fn assign(&mut self, lane: usize, end: Lsn, keys: Vec<u64>) {
        for k in &keys {
            self.writers.insert(*k, (end, lane));
        }
        if let Some(q) = self.queued.get_mut(lane) {
            q.push_back((end, keys));
        }
        self.next = (lane + 1) % self.lanes;
    }

    /// Uncommitted transactions placed in `lane`.
    #[cfg(test)]
    pub fn queued_in(&self, lane: usize) -> usize {
        self.queued.get(lane).map_or(0, VecDeque::len)
    }

    /// Nothing is in flight any more (everything committed or rolled back).
    pub fn clear(&mut self) {
        self.writers.clear();
        for q in &mut self.queued {
            q.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lsn(n: u64) -> Lsn {
        Lsn(n)
    }

    #[test]
    fn independent_transactions_spread_over_every_lane() {
        let mut s = Scheduler::new(3);
        let mut used = Vec::new();
        for (i, key) in [1u64, 2, 3].into_iter().enumerate() {
            let Placement::Free(l) = s.place(&[key]) else {
                panic!("no dependency, yet told to wait");
            };
            s.assign(l, lsn(10 + i as u64), vec![key]);
            used.push(l);
        }
        used.sort_unstable();
        assert_eq!(used, vec![0, 1, 2]);
    }

    #[test]
    fn a_transaction_on_a_key_in_flight_follows_it_into_its_lane() {
        let mut s = Scheduler::new(4);
        s.assign(2, lsn(10), vec![7, 8]);
        s.assign(0, lsn(20), vec![9]);
        // Same row (7), same unique value (8): always lane 2, whatever the load.
        assert_eq!(s.place(&[7]), Placement::Lane(2));
        assert_eq!(s.place(&[100, 8]), Placement::Lane(2));
        s.assign(2, lsn(30), vec![8]);
        // The last writer counts: 8 is now 30's, still in lane 2.
        s.retire(lsn(10));
        assert_eq!(s.place(&[8]), Placement::Lane(2));
        // 7 was only 10's: free once it committed.
        assert_ne!(s.place(&[7]), Placement::Wait);
    }

    #[test]
    fn keys_in_flight_in_two_lanes_wait_until_one_committed() {
        let mut s = Scheduler::new(2);
        s.assign(0, lsn(10), vec![1]);
        s.assign(1, lsn(20), vec![2]);
        assert_eq!(s.place(&[1, 2]), Placement::Wait);
        s.retire(lsn(10));
        assert_eq!(s.place(&[1, 2]), Placement::Lane(1));
        s.retire(lsn(20));
        assert_eq!(s.queued_in(0) + s.queued_in(1), 0);
        assert!(matches!(s.place(&[1, 2]), Placement::Free(_)));
    }

    #[test]
    fn retire_forgets_only_what_committed() {
        let mut s = Scheduler::new(2);
        s.assign(0, lsn(10), vec![1]);
        s.assign(0, lsn(30), vec![1]);
        s.assign(1, lsn(20), vec![2]);
        s.retire(lsn(20));
        assert_eq!(s.queued_in(0), 1);
        assert_eq!(s.queued_in(1), 0);
        assert_eq!(s.place(&[1]), Placement::Lane(0));
        s.clear();
        assert_eq!(s.queued_in(0), 0);
        assert!(matches!(s.place(&[1]), Placement::Free(_)));
    }

    #[test]
    fn one_lane_takes_everything() {
        let mut s = Scheduler::new(1);
        s.assign(0, lsn(10), vec![1]);
        assert_eq!(s.place(&[1]), Placement::Lane(0));
        assert_eq!(s.place(&[2]), Placement::Free(0));
    }
}
