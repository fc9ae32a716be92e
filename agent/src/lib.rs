//! mm-agent: the per-node replication daemon and the operator CLI's library.
//!
//! Where to find things: the apply path is `apply`, the streams from peers are
//! `stream`, turning Raft state into slots/streams is `cluster`, the Raft group
//! is `raft`, the HTTP API is `api`, the add-node protocol is `join`.

// Control plane.
pub mod api;
pub mod ctl;
pub mod join;
pub mod raft;

// Data plane.
pub mod apply;
pub mod cluster;
pub mod compensate;
pub mod conflict;
pub mod daemon;
pub mod lag;
pub mod metrics;
pub mod part;
pub mod pg;
pub mod prereq;
pub mod schema;
pub mod sequences;
pub mod status;
pub mod stream;
pub mod sync;
pub mod watermark;
