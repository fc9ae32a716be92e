//! The node-wide gate between fast-path and careful transactions.
//!
//! Every stream into a node applies on its own session, in parallel with
//! the others. A fast-path statement decides from its snapshot (the key's
//! tombstone, the table's truncate), and so does a careful transaction (the
//! row, its tombstone, the rows holding its unique values). Neither sees the
//! other's uncommitted work: a careful delete of key K raising K's tombstone
//! while another stream's fast INSERT of K is in flight left both committed
//! and K back on this node only (issue 9, race (a)).
//!
//! Invariant (a careful transaction decides from committed state only): a
//! fast-path transaction holds the gate shared from before its first
//! statement is sent until its COMMIT reply is read (or its pipeline is
//! drained after a failure); a careful transaction holds it exclusively from
//! before its BEGIN to after its COMMIT. So does each compensating delete
//! (`compensate.rs`): it raises a tombstone as a careful transaction does.
//! The lock is tokio's, which is fair:
//! once a careful transaction waits, new fast-path transactions queue behind
//! it, so neither side starves.
//!
//! The price: a careful transaction waits for every stream's in-flight
//! transactions, and while it runs, every stream's fast path waits. Careful
//! transactions are rare (conflicts); one fast-path transaction blocked on a
//! user's row lock holds every careful one up until that lock goes.

use std::sync::Arc;

use tokio::sync::{OwnedRwLockReadGuard, OwnedRwLockWriteGuard, RwLock};

pub type Shared = OwnedRwLockReadGuard<()>;
pub type Exclusive = OwnedRwLockWriteGuard<()>;

#[derive(Clone, Default)]
pub struct Gate(Arc<RwLock<()>>);

impl Gate {
    pub fn new() -> Self {
        Self::default()
    }

    /// Shared, if it is free of careful transactions, running or waiting.
    pub fn try_shared(&self) -> Option<Shared> {
        Arc::clone(&self.0).try_read_owned().ok()
    }

    pub async fn shared(&self) -> Shared {
        Arc::clone(&self.0).read_owned().await
    }

    pub async fn exclusive(&self) -> Exclusive {
        Arc::clone(&self.0).write_owned().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_waiting_careful_transaction_stops_new_fast_ones_and_gets_its_turn() {
        let g = Gate::new();
        let fast = g.shared().await;
        let g2 = g.clone();
        let careful = tokio::spawn(async move { g2.exclusive().await });
        // Let it queue.
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(
            !careful.is_finished(),
            "exclusive while a fast one holds it"
        );
        assert!(
            g.try_shared().is_none(),
            "a new fast transaction got past a waiting careful one"
        );
        drop(fast);
        let ex = careful.await.expect("task");
        assert!(g.try_shared().is_none());
        drop(ex);
        assert!(g.try_shared().is_some());
    }
}
