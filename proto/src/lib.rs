//! mm-proto: the wire formats mm speaks and the logical replication client.
//!
//! The codecs (`lsn`, `pgoutput`, `walsender`) are sans-I/O: pure functions of
//! bytes, so they can be unit-tested, property-tested and fuzzed without a
//! server. Only `client` touches sockets.

pub mod api;
pub mod client;
pub mod lsn;
pub mod pgoutput;
pub mod walsender;

pub use lsn::Lsn;
