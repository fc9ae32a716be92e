//! Property tests of the pgoutput codec: every message type, in and out of
//! stream blocks, under every protocol version where it exists, survives
//! encode -> decode unchanged; truncations and arbitrary bytes give errors,
//! never panics. Also replays the fuzz seed corpus through the fuzz oracle.

#![allow(clippy::unwrap_used)] // tests may unwrap

use bytes::{Bytes, BytesMut};
use mm_proto::Lsn;
use mm_proto::pgoutput::*;
use proptest::prelude::*;
use proptest::sample::select;

/// Every context a PostgreSQL session can be in.
fn contexts() -> Vec<DecodeContext> {
    let mut out = Vec::new();
    for protocol_version in 1..=4u8 {
        for in_stream_block in [false, true] {
            for parallel_streaming in [false, true] {
                let ctx = DecodeContext {
                    protocol_version,
                    in_stream_block,
                    parallel_streaming,
                };
                if ctx.validate().is_ok() {
                    out.push(ctx);
                }
            }
        }
    }
    out
}

fn lsn() -> impl Strategy<Value = Lsn> {
    any::<u64>().prop_map(Lsn)
}

fn ts() -> impl Strategy<Value = PgTimestamp> {
    any::<i64>().prop_map(PgTimestamp)
}

/// Any string PostgreSQL can send: UTF-8 without NUL.
fn name() -> impl Strategy<Value = String> {
    "[^\\x00]{0,12}"
}

fn payload() -> impl Strategy<Value = Bytes> {
    prop::collection::vec(any::<u8>(), 0..48).prop_map(Bytes::from)
}

fn column_value() -> impl Strategy<Value = ColumnValue> {
    prop_oneof![
        Just(ColumnValue::Null),
        Just(ColumnValue::UnchangedToast),
        payload().prop_map(ColumnValue::Text),
        payload().prop_map(ColumnValue::Binary),
    ]
}

fn tuple() -> impl Strategy<Value = TupleData> {
    prop::collection::vec(column_value(), 0..8).prop_map(TupleData::new)
}

fn old_tuple() -> impl Strategy<Value = OldTuple> {
    prop_oneof![
        tuple().prop_map(|t| OldTuple::Key(KeyTuple::from_wire(t))),
        tuple().prop_map(OldTuple::Full),
    ]
}

fn replica_identity() -> impl Strategy<Value = ReplicaIdentity> {
    select(vec![
        ReplicaIdentity::Default,
        ReplicaIdentity::Nothing,
        ReplicaIdentity::Full,
        ReplicaIdentity::Index,
    ])
}

fn relation_column() -> impl Strategy<Value = RelationColumn> {
    (any::<bool>(), name(), any::<u32>(), any::<i32>()).prop_map(
        |(is_key, name, type_oid, type_modifier)| RelationColumn {
            is_key,
            name,
            type_oid,
            type_modifier,
        },
    )
}

/// A message valid in `ctx` (data messages carry an xid exactly inside
/// stream blocks; control messages only where PostgreSQL sends them).
fn message(ctx: DecodeContext) -> BoxedStrategy<Message> {
    let xid = if ctx.in_stream_block {
        any::<u32>().prop_map(Some).boxed()
    } else {
        Just(None).boxed()
    };
    let v = ctx.protocol_version;
    let mut options: Vec<BoxedStrategy<Message>> = vec![
        (lsn(), name())
            .prop_map(|(commit_lsn, name)| Message::Origin(Origin { commit_lsn, name }))
            .boxed(),
        (
            xid.clone(),
            any::<u32>(),
            name(),
            name(),
            replica_identity(),
            prop::collection::vec(relation_column(), 0..6),
        )
            .prop_map(|(xid, oid, namespace, name, replica_identity, columns)| {
                Message::Relation(Relation {
                    xid,
                    oid,
                    namespace,
                    name,
                    replica_identity,
                    columns,
                })
            })
            .boxed(),
        (xid.clone(), any::<u32>(), name(), name())
            .prop_map(|(xid, oid, namespace, name)| {
                Message::Type(TypeMessage {
                    xid,
                    oid,
                    namespace,
                    name,
                })
            })
            .boxed(),
        (xid.clone(), any::<u32>(), tuple())
            .prop_map(|(xid, relation_oid, new)| {
                Message::Insert(Insert {
                    xid,
                    relation_oid,
                    new,
                })
            })
            .boxed(),
        (
            xid.clone(),
            any::<u32>(),
            prop::option::of(old_tuple()),
            tuple(),
        )
            .prop_map(|(xid, relation_oid, old, new)| {
                Message::Update(Update {
                    xid,
                    relation_oid,
                    old,
                    new,
                })
            })
            .boxed(),
        (xid.clone(), any::<u32>(), old_tuple())
            .prop_map(|(xid, relation_oid, old)| {
                Message::Delete(Delete {
                    xid,
                    relation_oid,
                    old,
                })
            })
            .boxed(),
        (
            xid.clone(),
            any::<bool>(),
            any::<bool>(),
            prop::collection::vec(any::<u32>(), 0..6),
        )
            .prop_map(|(xid, cascade, restart_identity, relation_oids)| {
                Message::Truncate(Truncate {
                    xid,
                    cascade,
                    restart_identity,
                    relation_oids,
                })
            })
            .boxed(),
        (xid, any::<bool>(), lsn(), name(), payload())
            .prop_map(|(xid, transactional, lsn, prefix, content)| {
                Message::Message(LogicalMessage {
                    xid,
                    transactional,
                    lsn,
                    prefix,
                    content,
                })
            })
            .boxed(),
    ];
    if ctx.in_stream_block {
        options.push(Just(Message::StreamStop).boxed());
    } else {
        options.push(
            (lsn(), ts(), any::<u32>())
                .prop_map(|(final_lsn, commit_timestamp, xid)| {
                    Message::Begin(Begin {
                        final_lsn,
                        commit_timestamp,
                        xid,
                    })
                })
                .boxed(),
        );
        options.push(
            (lsn(), lsn(), ts())
                .prop_map(|(commit_lsn, end_lsn, commit_timestamp)| {
                    Message::Commit(Commit {
                        commit_lsn,
                        end_lsn,
                        commit_timestamp,
                    })
                })
                .boxed(),
        );
        if v >= 2 {
            options.push(
                (any::<u32>(), any::<bool>())
                    .prop_map(|(xid, first_segment)| {
                        Message::StreamStart(StreamStart { xid, first_segment })
                    })
                    .boxed(),
            );
            options.push(
                (any::<u32>(), lsn(), lsn(), ts())
                    .prop_map(|(xid, commit_lsn, end_lsn, commit_timestamp)| {
                        Message::StreamCommit(StreamCommit {
                            xid,
                            commit_lsn,
                            end_lsn,
                            commit_timestamp,
                        })
                    })
                    .boxed(),
            );
            let abort_info = if ctx.abort_info_expected() {
                (lsn(), ts())
                    .prop_map(|(abort_lsn, abort_timestamp)| {
                        Some(StreamAbortInfo {
                            abort_lsn,
                            abort_timestamp,
                        })
                    })
                    .boxed()
            } else {
                Just(None).boxed()
            };
            options.push(
                (any::<u32>(), any::<u32>(), abort_info)
                    .prop_map(|(xid, subtransaction_xid, abort_info)| {
                        Message::StreamAbort(StreamAbort {
                            xid,
                            subtransaction_xid,
                            abort_info,
                        })
                    })
                    .boxed(),
            );
        }
        if v >= 3 {
            let prepared = || (lsn(), lsn(), ts(), any::<u32>(), name());
            options.push(
                prepared()
                    .prop_map(|(prepare_lsn, end_lsn, prepare_timestamp, xid, gid)| {
                        Message::BeginPrepare(BeginPrepare {
                            prepare_lsn,
                            end_lsn,
                            prepare_timestamp,
                            xid,
                            gid,
                        })
                    })
                    .boxed(),
            );
            options.push(
                prepared()
                    .prop_map(|(prepare_lsn, end_lsn, prepare_timestamp, xid, gid)| {
                        Message::Prepare(Prepare {
                            prepare_lsn,
                            end_lsn,
                            prepare_timestamp,
                            xid,
                            gid,
                        })
                    })
                    .boxed(),
            );
            options.push(
                prepared()
                    .prop_map(|(commit_lsn, end_lsn, commit_timestamp, xid, gid)| {
                        Message::CommitPrepared(CommitPrepared {
                            commit_lsn,
                            end_lsn,
                            commit_timestamp,
                            xid,
                            gid,
                        })
                    })
                    .boxed(),
            );
            options.push(
                prepared()
                    .prop_map(|(prepare_lsn, end_lsn, prepare_timestamp, xid, gid)| {
                        Message::StreamPrepare(StreamPrepare {
                            prepare_lsn,
                            end_lsn,
                            prepare_timestamp,
                            xid,
                            gid,
                        })
                    })
                    .boxed(),
            );
            options.push(
                (lsn(), lsn(), ts(), ts(), any::<u32>(), name())
                    .prop_map(
                        |(
                            prepare_end_lsn,
                            rollback_end_lsn,
                            prepare_timestamp,
                            rollback_timestamp,
                            xid,
                            gid,
                        )| {
                            Message::RollbackPrepared(RollbackPrepared {
                                prepare_end_lsn,
                                rollback_end_lsn,
                                prepare_timestamp,
                                rollback_timestamp,
                                xid,
                                gid,
                            })
                        },
                    )
                    .boxed(),
            );
        }
    }
    prop::strategy::Union::new(options).boxed()
}

fn ctx_and_message() -> impl Strategy<Value = (DecodeContext, Message)> {
    select(contexts()).prop_flat_map(|ctx| message(ctx).prop_map(move |m| (ctx, m)))
}

/// Any context, including ones no session produces.
fn any_context() -> impl Strategy<Value = DecodeContext> {
    (0u8..=6, any::<bool>(), any::<bool>()).prop_map(
        |(protocol_version, in_stream_block, parallel_streaming)| DecodeContext {
            protocol_version,
            in_stream_block,
            parallel_streaming,
        },
    )
}

/// If `bytes` decode, they must be the canonical encoding of the result.
fn assert_canonical(bytes: &Bytes, ctx: &DecodeContext) -> Result<(), TestCaseError> {
    if let Ok(msg) = decode(bytes.clone(), ctx) {
        let again = encode_to_bytes(&msg, ctx);
        prop_assert_eq!(again.as_ref(), Ok(bytes), "{:?} under {:?}", msg, ctx);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn encode_then_decode_is_identity((ctx, msg) in ctx_and_message()) {
        let bytes = encode_to_bytes(&msg, &ctx).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(bytes[0], msg.tag());
        let decoded = decode(bytes.clone(), &ctx);
        prop_assert_eq!(decoded.as_ref(), Ok(&msg));
    }

    #[test]
    fn every_truncation_is_an_error((ctx, msg) in ctx_and_message()) {
        let bytes = encode_to_bytes(&msg, &ctx).map_err(|e| TestCaseError::fail(e.to_string()))?;
        for cut in 0..bytes.len() {
            prop_assert!(decode(bytes.slice(..cut), &ctx).is_err(), "prefix {} of {:?}", cut, msg);
        }
    }

    #[test]
    fn corrupted_encodings_never_panic(
        (ctx, msg) in ctx_and_message(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
    ) {
        let bytes = encode_to_bytes(&msg, &ctx).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut corrupt = bytes.to_vec();
        for (at, value) in flips {
            let i = at.index(corrupt.len());
            corrupt[i] = value;
        }
        assert_canonical(&Bytes::from(corrupt), &ctx)?;
    }

    #[test]
    fn arbitrary_bytes_never_panic(
        ctx in any_context(),
        bytes in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        assert_canonical(&Bytes::from(bytes), &ctx)?;
    }

    /// Garbage that at least starts with a real message type, so it gets
    /// past the first byte.
    #[test]
    fn arbitrary_bodies_never_panic(
        ctx in any_context(),
        tag in select(b"BCORYIUDTMSEcAbPKrp".to_vec()),
        body in prop::collection::vec(
            prop_oneof![any::<u8>(), select(b"nutbKON\x00\x01".to_vec())], 0..64),
    ) {
        let mut bytes = vec![tag];
        bytes.extend(body);
        assert_canonical(&Bytes::from(bytes), &ctx)?;
    }

    /// A whole session: the sender's and receiver's trackers stay in step
    /// through stream blocks.
    #[test]
    fn streams_decode_in_sequence(
        version in 2u8..=4,
        parallel in any::<bool>(),
        seeds in prop::collection::vec(any::<u64>(), 1..40),
    ) {
        let parallel = parallel && version >= 4;
        let mut sender = StreamTracker::new(version, parallel);
        let mut receiver = StreamTracker::new(version, parallel);
        let mut runner = proptest::test_runner::TestRunner::deterministic();
        for seed in seeds {
            // Open or close a block now and then, otherwise a message fitting the state.
            let msg = match (seed % 7, sender.context().in_stream_block) {
                (0, false) => Message::StreamStart(StreamStart { xid: seed as u32, first_segment: seed % 2 == 0 }),
                (0, true) => Message::StreamStop,
                _ => message(sender.context()).new_tree(&mut runner).map_err(TestCaseError::fail)?.current(),
            };
            let mut out = BytesMut::new();
            sender.encode(&msg, &mut out).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let got = receiver.decode(out.freeze()).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(got, msg);
            prop_assert_eq!(receiver.context(), sender.context());
            prop_assert_eq!(receiver.stream_xid(), sender.stream_xid());
        }
    }
}

/// Replays the cargo-fuzz seed corpus (real PostgreSQL 18 messages, each
/// prefixed with the selector of the context it was captured in) through the
/// same oracle the fuzz target runs.
#[test]
fn fuzz_seed_corpus_replays() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/corpus-seed");
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(
        files.len() >= 19,
        "seed corpus missing: {} files",
        files.len()
    );
    let mut tags = std::collections::BTreeSet::new();
    for path in files {
        let data = std::fs::read(&path).unwrap();
        let outcome = oracle::check(&data).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(
            outcome.selected_decoded,
            "{} does not decode in its own context",
            path.display()
        );
        tags.insert(data[1]);
    }
    // Every message type is represented.
    let all: std::collections::BTreeSet<u8> = b"BCORYIUDTMSEcAbPKrp".iter().copied().collect();
    assert_eq!(tags, all);
}
