//! Unit tests: byte vectors captured from PostgreSQL 18.6 (by
//! `proto/fuzz/capture-pg18.sh`; the `// pg:` comments name the capture and
//! message index), a few hand-written ones for what a capture cannot produce,
//! and error cases.

use std::collections::HashMap;

use bytes::{Bytes, BytesMut};

use super::*;
use crate::Lsn;

/// Hex to bytes; ignores spaces and `|` so vectors can be laid out by field.
fn h(s: &str) -> Bytes {
    let digits: Vec<u8> = s.bytes().filter(|b| b.is_ascii_hexdigit()).collect();
    assert_eq!(digits.len() % 2, 0, "odd hex: {s}");
    digits
        .chunks(2)
        .map(|p| u8::from_str_radix(std::str::from_utf8(p).unwrap(), 16).unwrap())
        .collect::<Vec<u8>>()
        .into()
}

fn t(s: &str) -> ColumnValue {
    ColumnValue::Text(Bytes::copy_from_slice(s.as_bytes()))
}

fn b(bytes: &[u8]) -> ColumnValue {
    ColumnValue::Binary(Bytes::copy_from_slice(bytes))
}

fn row(columns: Vec<ColumnValue>) -> TupleData {
    TupleData { columns }
}

const V1: DecodeContext = DecodeContext::new(1);
const V2: DecodeContext = DecodeContext::new(2);
const V3: DecodeContext = DecodeContext::new(3);
const V4_PARALLEL: DecodeContext = DecodeContext {
    protocol_version: 4,
    in_stream_block: false,
    parallel_streaming: true,
};

fn streaming(ctx: DecodeContext) -> DecodeContext {
    DecodeContext {
        in_stream_block: true,
        ..ctx
    }
}

/// The full contract for one valid vector: decodes to `expected`, encodes
/// back to the same bytes, every strict prefix and any trailing byte is an
/// error (not a panic), and the oracle agrees under every context.
fn check(ctx: DecodeContext, hex: &str, expected: Message) {
    let bytes = h(hex);
    let decoded = decode(bytes.clone(), &ctx).unwrap_or_else(|e| panic!("{hex}: {e}"));
    assert_eq!(decoded, expected);
    assert_eq!(
        encode_to_bytes(&expected, &ctx).unwrap(),
        bytes,
        "encoding {expected:?}"
    );
    for cut in 0..bytes.len() {
        let r = decode(bytes.slice(..cut), &ctx);
        assert!(r.is_err(), "prefix of {cut} bytes decoded: {r:?}");
    }
    let mut longer = bytes.to_vec();
    longer.push(0);
    assert_eq!(
        decode(longer.into(), &ctx),
        Err(DecodeError::TrailingBytes {
            message: expected.name(),
            offset: bytes.len(),
            count: 1
        })
    );
    let mut with_selector = vec![oracle::selector_for(&ctx)];
    with_selector.extend_from_slice(&bytes);
    let outcome = oracle::check(&with_selector).unwrap();
    assert!(outcome.selected_decoded);
}

#[test]
fn begin_commit() {
    // pg: v1-text #0, #4
    check(
        V1,
        "42 | 00000000 0174c298 | 0003046b 905f0c6e | 000002fd",
        Message::Begin(Begin {
            final_lsn: Lsn(0x0174_c298),
            commit_timestamp: PgTimestamp(0x0003_046b_905f_0c6e),
            xid: 0x2fd,
        }),
    );
    check(
        V1,
        "43 | 00 | 00000000 0174c298 | 00000000 0174c2c8 | 0003046b 905f0c6e",
        Message::Commit(Commit {
            commit_lsn: Lsn(0x0174_c298),
            end_lsn: Lsn(0x0174_c2c8),
            commit_timestamp: PgTimestamp(0x0003_046b_905f_0c6e),
        }),
    );
}

#[test]
fn origin() {
    // pg: v1-text #63, the transaction set up with
    // pg_replication_origin_xact_setup('16/B374D848', ...)
    let ori = Message::Origin(Origin {
        commit_lsn: "16/B374D848".parse().unwrap(),
        name: "mm_upstream".into(),
    });
    check(
        V1,
        "4f | 00000016 b374d848 | 6d6d5f757073747265616d00",
        ori.clone(),
    );
    // pgoutput_stream_start sends ORIGIN inside the block, without xid prefix.
    check(
        streaming(V2),
        "4f | 00000016 b374d848 | 6d6d5f757073747265616d00",
        ori,
    );
}

fn t_default_relation(xid: Option<u32>) -> Relation {
    let col = |is_key, name: &str, type_oid, type_modifier| RelationColumn {
        is_key,
        name: name.into(),
        type_oid,
        type_modifier,
    };
    Relation {
        xid,
        oid: 0x4007,
        namespace: "public".into(),
        name: "t_default".into(),
        replica_identity: ReplicaIdentity::Default,
        columns: vec![
            col(true, "id", 23, -1),
            col(false, "name", 25, -1),
            col(false, "big", 25, -1),
            col(false, "m", 0x4001, -1),
            // numeric(10,2): typmod ((10 << 16) | 2) + 4
            col(false, "n", 1700, 655_366),
            col(false, "ts", 1184, -1),
        ],
    }
}

#[test]
fn relation_and_type() {
    // pg: v1-text #2
    check(
        V1,
        "52 | 00004007 | 7075626c696300 | 745f64656661756c7400 | 64 | 0006 \
         | 01 696400 00000017 ffffffff | 00 6e616d6500 00000019 ffffffff \
         | 00 62696700 00000019 ffffffff | 00 6d00 00004001 ffffffff \
         | 00 6e00 000006a4 000a0006 | 00 747300 000004a0 ffffffff",
        Message::Relation(t_default_relation(None)),
    );
    // pg: v1-text #1
    check(
        V1,
        "59 | 00004001 | 7075626c696300 | 6d6f6f6400",
        Message::Type(TypeMessage {
            xid: None,
            oid: 0x4001,
            namespace: "public".into(),
            name: "mood".into(),
        }),
    );
    // Hand-written: pg_catalog is sent as an empty namespace; other identities.
    for (byte, identity) in [
        ("6e", ReplicaIdentity::Nothing),
        ("66", ReplicaIdentity::Full),
        ("69", ReplicaIdentity::Index),
    ] {
        check(
            V1,
            &format!("52 | 00000001 | 00 | 7400 | {byte} | 0000"),
            Message::Relation(Relation {
                xid: None,
                oid: 1,
                namespace: String::new(),
                name: "t".into(),
                replica_identity: identity,
                columns: vec![],
            }),
        );
    }
}

#[test]
fn insert_text_and_binary() {
    // pg: v3-twophase #2
    check(
        V3,
        "49 | 0000401c | 4e | 0002 | 74 00000002 3130 | 74 00000008 7072657061726564",
        Message::Insert(Insert {
            xid: None,
            relation_oid: 0x401c,
            new: row(vec![t("10"), t("prepared")]),
        }),
    );
    // pg: v2-binary #3, binary 'true': int4 3, text, NULL, enum, numeric
    // -1.25, timestamptz 2000-01-01 (= 0 microseconds).
    check(
        V2,
        "49 | 00004007 | 4e | 0006 | 62 00000004 00000003 | 62 00000005 7468726565 | 6e \
         | 62 00000002 6f6b | 62 0000000c 000200004000000200 0109c4 | 62 00000008 0000000000000000",
        Message::Insert(Insert {
            xid: None,
            relation_oid: 0x4007,
            new: row(vec![
                b(&[0, 0, 0, 3]),
                b(b"three"),
                ColumnValue::Null,
                b(b"ok"),
                b(&[0, 2, 0, 0, 0x40, 0, 0, 2, 0, 1, 0x09, 0xc4]),
                b(&[0; 8]),
            ]),
        }),
    );
}

#[test]
fn update_variants() {
    // pg: v1-text #9: `big` is an unchanged out-of-line value: 'u', not NULL.
    check(
        V1,
        "55 | 00004007 | 4e | 0006 | 74 00000001 31 | 74 00000003 756e6f | 75 \
         | 74 00000005 6861707079 | 74 00000005 31322e3530 \
         | 74 0000001d 323032362d31312d32392031363a30303a30302e3132333435362b3030",
        Message::Update(Update {
            xid: None,
            relation_oid: 0x4007,
            old: None,
            new: row(vec![
                t("1"),
                t("uno"),
                ColumnValue::UnchangedToast,
                t("happy"),
                t("12.50"),
                t("2026-11-29 16:00:00.123456+00"),
            ]),
        }),
    );
    // pg: v1-text #36: key (b, a) changed under REPLICA IDENTITY USING INDEX.
    check(
        V1,
        "55 | 00004014 | 4b | 0003 | 74 00000001 31 | 74 00000001 32 | 6e \
         | 4e | 0003 | 74 00000001 35 | 74 00000001 32 | 74 00000002 6363",
        Message::Update(Update {
            xid: None,
            relation_oid: 0x4014,
            old: Some(OldTuple::Key(KeyTuple::from_wire(row(vec![
                t("1"),
                t("2"),
                ColumnValue::Null,
            ])))),
            new: row(vec![t("5"), t("2"), t("cc")]),
        }),
    );
    // pg: v1-text #23: REPLICA IDENTITY FULL.
    check(
        V1,
        "55 | 0000400f | 4f | 0003 | 74 00000001 31 | 74 00000001 62 | 74 00000001 63 \
         | 4e | 0003 | 74 00000001 31 | 74 00000002 6262 | 74 00000001 63",
        Message::Update(Update {
            xid: None,
            relation_oid: 0x400f,
            old: Some(OldTuple::Full(row(vec![t("1"), t("b"), t("c")]))),
            new: row(vec![t("1"), t("bb"), t("c")]),
        }),
    );
}

#[test]
fn delete_variants() {
    // pg: v1-text #15
    check(
        V1,
        "44 | 00004007 | 4b | 0006 | 74 00000001 32 | 6e 6e 6e 6e 6e",
        Message::Delete(Delete {
            xid: None,
            relation_oid: 0x4007,
            old: OldTuple::Key(KeyTuple::from_wire(row(vec![
                t("2"),
                ColumnValue::Null,
                ColumnValue::Null,
                ColumnValue::Null,
                ColumnValue::Null,
                ColumnValue::Null,
            ]))),
        }),
    );
    // pg: v1-text #26: in an 'O' tuple 'n' is a real NULL.
    check(
        V1,
        "44 | 0000400f | 4f | 0003 | 74 00000001 32 | 6e | 74 00000002 7a7a",
        Message::Delete(Delete {
            xid: None,
            relation_oid: 0x400f,
            old: OldTuple::Full(row(vec![t("2"), ColumnValue::Null, t("zz")])),
        }),
    );
}

#[test]
fn truncate() {
    // pg: v1-text #55, #60
    check(
        V1,
        "54 | 00000001 | 00 | 0000401c",
        Message::Truncate(Truncate {
            xid: None,
            cascade: false,
            restart_identity: false,
            relation_oids: vec![0x401c],
        }),
    );
    check(
        V1,
        "54 | 00000002 | 03 | 0000400f 00004014",
        Message::Truncate(Truncate {
            xid: None,
            cascade: true,
            restart_identity: true,
            relation_oids: vec![0x400f, 0x4014],
        }),
    );
}

#[test]
fn logical_messages() {
    // pg: v1-text #46, #48
    check(
        V1,
        "4d | 01 | 00000000 0174cb48 | 6d6d2e7465737400 | 00000015 | 7472616e73616374696f6e616c207061796c6f6164",
        Message::Message(LogicalMessage {
            xid: None,
            transactional: true,
            lsn: Lsn(0x0174_cb48),
            prefix: "mm.test".into(),
            content: Bytes::from_static(b"transactional payload"),
        }),
    );
    check(
        V1,
        "4d | 00 | 00000000 0174cbb8 | 6d6d2e7465737400 | 00000003 | 00ff00",
        Message::Message(LogicalMessage {
            xid: None,
            transactional: false,
            lsn: Lsn(0x0174_cbb8),
            prefix: "mm.test".into(),
            content: Bytes::from_static(b"\x00\xff\x00"),
        }),
    );
}

#[test]
fn streamed_data_messages_carry_xid() {
    let s = streaming(V2);
    // pg: v2-stream #0, #1, #2, #458
    check(
        V2,
        "53 | 00000312 | 01",
        Message::StreamStart(StreamStart {
            xid: 0x312,
            first_segment: true,
        }),
    );
    check(
        V2,
        "53 | 00000312 | 00",
        Message::StreamStart(StreamStart {
            xid: 0x312,
            first_segment: false,
        }),
    );
    check(
        s,
        "52 | 00000312 | 00004022 | 7075626c696300 | 745f62756c6b00 | 64 | 0002 \
         | 01 696400 00000014 ffffffff | 00 7061796c6f616400 00000019 ffffffff",
        Message::Relation(Relation {
            xid: Some(0x312),
            oid: 0x4022,
            namespace: "public".into(),
            name: "t_bulk".into(),
            replica_identity: ReplicaIdentity::Default,
            columns: vec![
                RelationColumn {
                    is_key: true,
                    name: "id".into(),
                    type_oid: 20,
                    type_modifier: -1,
                },
                RelationColumn {
                    is_key: false,
                    name: "payload".into(),
                    type_oid: 25,
                    type_modifier: -1,
                },
            ],
        }),
    );
    check(
        s,
        "49 | 00000312 | 00004022 | 4e | 0002 | 74 00000001 31 | 74 00000005 726f772031",
        Message::Insert(Insert {
            xid: Some(0x312),
            relation_oid: 0x4022,
            new: row(vec![t("1"), t("row 1")]),
        }),
    );
    check(s, "45", Message::StreamStop);
    // pg: v2-stream #1378..#1385 (xid 0x314: a subtransaction of 0x312)
    check(
        s,
        "55 | 00000314 | 00004022 | 4e | 0002 | 74 00000001 31 | 74 00000007 75706461746564",
        Message::Update(Update {
            xid: Some(0x314),
            relation_oid: 0x4022,
            old: None,
            new: row(vec![t("1"), t("updated")]),
        }),
    );
    check(
        s,
        "44 | 00000314 | 00004022 | 4b | 0002 | 74 00000001 32 | 6e",
        Message::Delete(Delete {
            xid: Some(0x314),
            relation_oid: 0x4022,
            old: OldTuple::Key(KeyTuple::from_wire(row(vec![t("2"), ColumnValue::Null]))),
        }),
    );
    check(
        s,
        "59 | 00000314 | 00004001 | 7075626c696300 | 6d6f6f6400",
        Message::Type(TypeMessage {
            xid: Some(0x314),
            oid: 0x4001,
            namespace: "public".into(),
            name: "mood".into(),
        }),
    );
    check(
        s,
        "4d | 00000312 | 01 | 00000000 017865f0 | 6d6d00 | 00000008 | 73747265616d6564",
        Message::Message(LogicalMessage {
            xid: Some(0x312),
            transactional: true,
            lsn: Lsn(0x0178_65f0),
            prefix: "mm".into(),
            content: Bytes::from_static(b"streamed"),
        }),
    );
    check(
        s,
        "54 | 00000314 | 00000001 | 00 | 0000401c",
        Message::Truncate(Truncate {
            xid: Some(0x314),
            cascade: false,
            restart_identity: false,
            relation_oids: vec![0x401c],
        }),
    );
}

#[test]
fn stream_commit_and_abort() {
    // pg: v2-stream #1387, #1375 (subtransaction 0x313 of 0x312 rolled back)
    check(
        V2,
        "63 | 00000312 | 00 | 00000000 01786ea8 | 00000000 01786fc0 | 0003046b 906150bf",
        Message::StreamCommit(StreamCommit {
            xid: 0x312,
            commit_lsn: Lsn(0x0178_6ea8),
            end_lsn: Lsn(0x0178_6fc0),
            commit_timestamp: PgTimestamp(0x0003_046b_9061_50bf),
        }),
    );
    let sub_abort = StreamAbort {
        xid: 0x312,
        subtransaction_xid: 0x313,
        abort_info: None,
    };
    check(
        V2,
        "41 | 00000312 | 00000313",
        Message::StreamAbort(sub_abort.clone()),
    );
    // Protocol 4 without parallel streaming: still no abort info.
    check(
        DecodeContext::new(4),
        "41 | 00000312 | 00000313",
        Message::StreamAbort(sub_abort),
    );
    // pg: v4-parallel #1375: abort LSN and time follow.
    check(
        V4_PARALLEL,
        "41 | 00000319 | 0000031a | 00000000 01805da0 | 0003046b 90647d48",
        Message::StreamAbort(StreamAbort {
            xid: 0x319,
            subtransaction_xid: 0x31a,
            abort_info: Some(StreamAbortInfo {
                abort_lsn: Lsn(0x0180_5da0),
                abort_timestamp: PgTimestamp(0x0003_046b_9064_7d48),
            }),
        }),
    );
    // Hand-written: top-level abort (xid == subxid), which a capture through
    // the SQL interface cannot produce (see capture-pg18.sh).
    check(
        V4_PARALLEL,
        "41 | 00000320 | 00000320 | 00000000 02000000 | ffffffff ffffffff",
        Message::StreamAbort(StreamAbort {
            xid: 0x320,
            subtransaction_xid: 0x320,
            abort_info: Some(StreamAbortInfo {
                abort_lsn: Lsn(0x0200_0000),
                abort_timestamp: PgTimestamp(-1),
            }),
        }),
    );
    // The same bytes mean different things under the two contexts: the v4
    // message is a v2 message with trailing bytes.
    assert!(matches!(
        decode(
            h("41 00000319 0000031a 0000000001805da0 0003046b90647d48"),
            &V2
        ),
        Err(DecodeError::TrailingBytes {
            offset: 9,
            count: 16,
            ..
        })
    ));
}

#[test]
fn two_phase() {
    let gid1 = "mm-gid-1".to_string();
    // pg: v3-twophase #0, #3, #4, #8, #1016
    check(
        V3,
        "62 | 00000000 017a9768 | 00000000 017a9868 | 0003046b 90628c86 | 00000316 | 6d6d2d6769642d3100",
        Message::BeginPrepare(BeginPrepare {
            prepare_lsn: Lsn(0x017a_9768),
            end_lsn: Lsn(0x017a_9868),
            prepare_timestamp: PgTimestamp(0x0003_046b_9062_8c86),
            xid: 0x316,
            gid: gid1.clone(),
        }),
    );
    check(
        V3,
        "50 | 00 | 00000000 017a9768 | 00000000 017a9868 | 0003046b 90628c86 | 00000316 | 6d6d2d6769642d3100",
        Message::Prepare(Prepare {
            prepare_lsn: Lsn(0x017a_9768),
            end_lsn: Lsn(0x017a_9868),
            prepare_timestamp: PgTimestamp(0x0003_046b_9062_8c86),
            xid: 0x316,
            gid: gid1.clone(),
        }),
    );
    check(
        V3,
        "4b | 00 | 00000000 017a9868 | 00000000 017a98a8 | 0003046b 90628d97 | 00000316 | 6d6d2d6769642d3100",
        Message::CommitPrepared(CommitPrepared {
            commit_lsn: Lsn(0x017a_9868),
            end_lsn: Lsn(0x017a_98a8),
            commit_timestamp: PgTimestamp(0x0003_046b_9062_8d97),
            xid: 0x316,
            gid: gid1,
        }),
    );
    check(
        V3,
        "72 | 00 | 00000000 017a99f0 | 00000000 017a9a30 | 0003046b 90628f20 | 0003046b 90628f97 | 00000317 | 6d6d2d6769642d3200",
        Message::RollbackPrepared(RollbackPrepared {
            prepare_end_lsn: Lsn(0x017a_99f0),
            rollback_end_lsn: Lsn(0x017a_9a30),
            prepare_timestamp: PgTimestamp(0x0003_046b_9062_8f20),
            rollback_timestamp: PgTimestamp(0x0003_046b_9062_8f97),
            xid: 0x317,
            gid: "mm-gid-2".into(),
        }),
    );
    check(
        V3,
        "70 | 00 | 00000000 017cc4a8 | 00000000 017cc5c8 | 0003046b 9062ba53 | 00000318 | 6d6d2d6769642d3300",
        Message::StreamPrepare(StreamPrepare {
            prepare_lsn: Lsn(0x017c_c4a8),
            end_lsn: Lsn(0x017c_c5c8),
            prepare_timestamp: PgTimestamp(0x0003_046b_9062_ba53),
            xid: 0x318,
            gid: "mm-gid-3".into(),
        }),
    );
}

#[test]
fn values_are_slices_of_the_input() {
    let bytes = h("49 | 0000401c | 4e | 0002 | 74 00000002 3130 | 62 00000003 010203");
    let range = bytes.as_ptr_range();
    let Message::Insert(insert) = decode(bytes.clone(), &V1).unwrap() else {
        panic!("not an insert")
    };
    for value in &insert.new.columns {
        let v = value.bytes().unwrap();
        assert!(range.contains(&v.as_ptr()), "{value:?} was copied");
    }
}

fn err(ctx: DecodeContext, hex: &str) -> DecodeError {
    match decode(h(hex), &ctx) {
        Ok(m) => panic!("{hex} decoded as {m:?}"),
        Err(e) => {
            assert!(!e.to_string().is_empty());
            e
        }
    }
}

#[test]
fn malformed_input_errors() {
    use DecodeError::*;
    assert_eq!(
        err(V1, ""),
        Truncated {
            what: "message type",
            offset: 0,
            needed: 1,
            available: 0
        }
    );
    assert_eq!(err(V1, "5a"), UnknownMessageType { tag: b'Z' });
    assert_eq!(err(V1, "00"), UnknownMessageType { tag: 0 });
    // Column kind 'x'.
    assert_eq!(
        err(V1, "49 0000401c 4e 0001 78"),
        UnknownColumnKind {
            offset: 8,
            kind: b'x'
        }
    );
    // INSERT needs 'N'; UPDATE 'K'/'O'/'N' then 'N'; DELETE 'K'/'O'.
    assert!(matches!(
        err(V1, "49 0000401c 4b 0000"),
        UnexpectedTupleMarker {
            offset: 5,
            found: b'K',
            ..
        }
    ));
    assert!(matches!(
        err(V1, "55 0000401c 58 0000"),
        UnexpectedTupleMarker {
            offset: 5,
            found: b'X',
            ..
        }
    ));
    assert!(matches!(
        err(V1, "55 0000401c 4b 0000 4b 0000"),
        UnexpectedTupleMarker {
            offset: 8,
            found: b'K',
            ..
        }
    ));
    assert!(matches!(
        err(V1, "44 0000401c 4e 0000"),
        UnexpectedTupleMarker {
            offset: 5,
            found: b'N',
            ..
        }
    ));
    // Strings: invalid UTF-8, missing terminator.
    assert_eq!(
        err(V1, "59 00000001 ff00 7400"),
        InvalidUtf8 {
            what: "type namespace",
            offset: 5
        }
    );
    assert_eq!(
        err(V1, "59 00000001 00 7474"),
        UnterminatedString {
            what: "type name",
            offset: 6
        }
    );
    // Counts that cannot fit: no giant allocation, an error.
    assert!(matches!(
        err(V1, "49 0000401c 4e ffff 6e6e6e"),
        CountTooLarge {
            count: 0xffff,
            available: 3,
            ..
        }
    ));
    assert!(matches!(
        err(V1, "54 ffffffff 00 00000001"),
        CountTooLarge {
            count: 0xffff_ffff,
            ..
        }
    ));
    assert!(matches!(
        err(V1, "52 00000001 00 7400 64 0100 00 00 00000000 00000000"),
        CountTooLarge { count: 0x100, .. }
    ));
    // A length claiming more than is there.
    assert!(matches!(
        err(V1, "49 0000401c 4e 0001 74 ffffffff 41"),
        Truncated {
            what: "text value",
            offset: 13,
            needed: 0xffff_ffff,
            available: 1
        }
    ));
    // Flag bytes with undefined bits.
    assert!(matches!(
        err(
            V1,
            "43 01 0000000000000000 0000000000000000 0000000000000000"
        ),
        InvalidField {
            what: "COMMIT flags",
            value: 1,
            ..
        }
    ));
    assert!(matches!(
        err(V2, "53 00000001 02"),
        InvalidField { value: 2, .. }
    ));
    assert!(matches!(
        err(V1, "4d 02 0000000000000000 00 00000000"),
        InvalidField { value: 2, .. }
    ));
    assert!(matches!(
        err(V1, "54 00000000 04"),
        InvalidField {
            what: "TRUNCATE options",
            value: 4,
            ..
        }
    ));
    assert!(matches!(
        err(V1, "52 00000001 00 7400 64 0001 02 6100 00000017 ffffffff"),
        InvalidField {
            what: "column flags",
            value: 2,
            ..
        }
    ));
    assert!(matches!(
        err(V1, "52 00000001 00 7400 78 0000"),
        InvalidField {
            what: "replica identity",
            value: 0x78,
            ..
        }
    ));
}

#[test]
fn context_violations() {
    use ContextViolation::*;
    let violation = |ctx, hex| match err(ctx, hex) {
        DecodeError::UnexpectedMessage { violation, .. } => violation,
        e => panic!("{hex}: {e:?}"),
    };
    assert_eq!(violation(V2, "45"), OutsideStreamBlock);
    assert_eq!(
        violation(
            streaming(V2),
            "42 0000000000000001 0000000000000000 00000001"
        ),
        InsideStreamBlock
    );
    assert_eq!(
        violation(streaming(V2), "53 00000001 01"),
        InsideStreamBlock
    );
    assert_eq!(
        violation(streaming(V2), "41 00000001 00000001"),
        InsideStreamBlock
    );
    assert_eq!(
        violation(V1, "53 00000001 01"),
        RequiresProtocol {
            min: 2,
            negotiated: 1
        }
    );
    assert_eq!(
        violation(
            V2,
            "62 0000000000000001 0000000000000002 0000000000000000 00000001 6700"
        ),
        RequiresProtocol {
            min: 3,
            negotiated: 2
        }
    );
    for (ctx, expected) in [
        (
            DecodeContext::new(0),
            InvalidContext::UnsupportedProtocolVersion(0),
        ),
        (
            DecodeContext::new(5),
            InvalidContext::UnsupportedProtocolVersion(5),
        ),
        (streaming(V1), InvalidContext::StreamingNeedsV2(1)),
        (
            DecodeContext {
                parallel_streaming: true,
                ..V3
            },
            InvalidContext::ParallelNeedsV4(3),
        ),
    ] {
        assert_eq!(err(ctx, "45"), DecodeError::InvalidContext(expected));
    }
}

#[test]
fn encode_refuses_what_decode_would_refuse() {
    let mut out = BytesMut::from(&b"keep"[..]);
    let insert = |xid| {
        Message::Insert(Insert {
            xid,
            relation_oid: 1,
            new: row(vec![]),
        })
    };
    let cases: Vec<(Message, DecodeContext)> = vec![
        (insert(Some(7)), V2),
        (insert(None), streaming(V2)),
        (Message::StreamStop, V2),
        (Message::StreamStop, V1),
        (
            Message::Origin(Origin {
                commit_lsn: Lsn(1),
                name: "a\0b".into(),
            }),
            V1,
        ),
        (
            Message::StreamAbort(StreamAbort {
                xid: 1,
                subtransaction_xid: 1,
                abort_info: None,
            }),
            V4_PARALLEL,
        ),
        (
            Message::StreamAbort(StreamAbort {
                xid: 1,
                subtransaction_xid: 1,
                abort_info: Some(StreamAbortInfo {
                    abort_lsn: Lsn(1),
                    abort_timestamp: PgTimestamp(1),
                }),
            }),
            V2,
        ),
        (
            Message::Insert(Insert {
                xid: None,
                relation_oid: 1,
                new: row(vec![ColumnValue::Null; 70_000]),
            }),
            V1,
        ),
        (insert(None), DecodeContext::new(9)),
    ];
    for (msg, ctx) in cases {
        let r = encode(&msg, &ctx, &mut out);
        assert!(r.is_err(), "{msg:?} encoded under {ctx:?}");
        assert_eq!(&out[..], b"keep", "a failed encode left bytes behind");
    }
    // A valid encode appends.
    encode(&Message::StreamStop, &streaming(V2), &mut out).unwrap();
    assert_eq!(&out[..], b"keepE");
}

#[test]
fn key_tuple_hides_not_sent_columns() {
    let rel = t_default_relation(None);
    // pg: v1-text #15: DELETE by primary key; five non-key columns sent as 'n'.
    let Message::Delete(Delete {
        old: OldTuple::Key(key),
        ..
    }) = decode(h("44 00004007 4b 0006 74 00000001 32 6e6e6e6e6e"), &V1).unwrap()
    else {
        panic!("not a key delete")
    };
    let values: Vec<KeyValue> = key.values(&rel).unwrap().collect();
    assert_eq!(values[0], KeyValue::Key(&t("2")));
    assert!(values[1..].iter().all(|v| *v == KeyValue::NotSent));
    let keys: Vec<_> = key.key_columns(&rel).unwrap().collect();
    assert_eq!(keys, vec![(0, &t("2"))]);
    assert_eq!(key.get(&rel, 1).unwrap(), Some(KeyValue::NotSent));
    assert_eq!(key.get(&rel, 6).unwrap(), None);
    assert_eq!(key.width(), 6);
    // Read with the wrong relation: refused, not misinterpreted.
    let mut narrow = rel.clone();
    narrow.columns.truncate(2);
    assert_eq!(
        key.values(&narrow).err(),
        Some(KeyTupleMismatch {
            relation_oid: 0x4007,
            relation_columns: 2,
            tuple_columns: 6
        })
    );
    // from_row builds what PostgreSQL sends.
    let full = row(vec![
        t("2"),
        t("x"),
        ColumnValue::UnchangedToast,
        t("ok"),
        t("1"),
        t("t"),
    ]);
    assert_eq!(KeyTuple::from_row(&rel, &full).unwrap(), key);
}

/// (capture file, protocol version, parallel streaming)
const CAPTURES: &[(&str, u8, bool)] = &[
    ("v1-text", 1, false),
    ("v2-binary", 2, false),
    ("v2-stream", 2, false),
    ("v3-twophase", 3, false),
    ("v4-parallel", 4, true),
];

fn capture(name: &str) -> Vec<Bytes> {
    let path = format!("{}/fuzz/captures/{name}.framed", env!("CARGO_MANIFEST_DIR"));
    let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    read_framed(data.into()).collect::<Result<_, _>>().unwrap()
}

/// Decodes a whole capture in order; checks each message re-encodes to the
/// exact captured bytes.
fn decode_capture(name: &str) -> Vec<Message> {
    let &(_, version, parallel) = CAPTURES.iter().find(|c| c.0 == name).unwrap();
    let mut tracker = StreamTracker::new(version, parallel);
    capture(name)
        .into_iter()
        .enumerate()
        .map(|(i, raw)| {
            let ctx = tracker.context();
            let msg = tracker
                .decode(raw.clone())
                .unwrap_or_else(|e| panic!("{name} #{i}: {e}"));
            assert_eq!(encode_to_bytes(&msg, &ctx).unwrap(), raw, "{name} #{i}");
            assert_eq!(
                msg.stream_xid().is_some(),
                ctx.in_stream_block && msg.tag() != b'E' && msg.tag() != b'O',
                "{name} #{i}"
            );
            msg
        })
        .collect()
}

/// Tags in order, runs of the same tag written as `Ix456`.
fn shape(msgs: &[Message]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut run = 0;
    for (i, m) in msgs.iter().enumerate() {
        run += 1;
        if msgs.get(i + 1).map(Message::tag) != Some(m.tag()) {
            let t = char::from(m.tag());
            out.push(if run > 1 {
                format!("{t}x{run}")
            } else {
                t.to_string()
            });
            run = 0;
        }
    }
    out.join(" ")
}

#[test]
fn capture_v1_text() {
    let msgs = decode_capture("v1-text");
    assert_eq!(
        shape(&msgs),
        "B Y R I C B I C B U C B U C B D C B R Ix2 C B U C B D C B R I C B U C B U C B D C \
         B R I C B M C M B I M C B R T C B Rx2 T C B O R I C"
    );
    let mut relations: HashMap<u32, Relation> = HashMap::new();
    let mut key_columns_seen = Vec::new();
    for (i, m) in msgs.iter().enumerate() {
        match m {
            Message::Relation(r) => {
                relations.insert(r.oid, r.clone());
            }
            Message::Begin(b) => {
                // Each BEGIN's final LSN and timestamp match its COMMIT.
                let commit = msgs[i..].iter().find_map(|m| match m {
                    Message::Commit(c) => Some(c),
                    _ => None,
                });
                let commit = commit.unwrap();
                assert_eq!(commit.commit_lsn, b.final_lsn);
                assert_eq!(commit.commit_timestamp, b.commit_timestamp);
            }
            Message::Update(Update {
                old: Some(OldTuple::Key(k)),
                relation_oid,
                ..
            })
            | Message::Delete(Delete {
                old: OldTuple::Key(k),
                relation_oid,
                ..
            }) => {
                let rel = &relations[relation_oid];
                let keys: Vec<String> = k
                    .key_columns(rel)
                    .unwrap()
                    .map(|(i, _)| rel.columns[i].name.clone())
                    .collect();
                key_columns_seen.push((rel.name.clone(), keys));
            }
            _ => {}
        }
    }
    // Primary key for t_default; the (b, a) index for t_index.
    assert_eq!(
        key_columns_seen,
        vec![
            ("t_default".to_string(), vec!["id".to_string()]),
            ("t_default".into(), vec!["id".into()]),
            ("t_index".into(), vec!["a".into(), "b".into()]),
            ("t_index".into(), vec!["a".into(), "b".into()]),
        ]
    );
    assert_eq!(relations[&0x400f].replica_identity, ReplicaIdentity::Full);
    assert!(relations[&0x400f].columns.iter().all(|c| c.is_key));
    assert_eq!(
        relations[&0x401c].replica_identity,
        ReplicaIdentity::Nothing
    );
    // The enum column's type OID is the one the TYPE message described.
    let Message::Type(ty) = &msgs[1] else {
        panic!()
    };
    assert_eq!(relations[&0x4007].columns[3].type_oid, ty.oid);
    // ORIGIN carries what pg_replication_origin_xact_setup was given.
    let origin = msgs.iter().find_map(|m| match m {
        Message::Origin(o) => Some(o),
        _ => None,
    });
    assert_eq!(origin.unwrap().commit_lsn, "16/B374D848".parse().unwrap());
    // The committed timestamps print as timestamptz literals of today-ish.
    let Message::Begin(first) = &msgs[0] else {
        panic!()
    };
    assert!(first.commit_timestamp.to_datetime().is_some());
}

#[test]
fn capture_streams() {
    let msgs = decode_capture("v2-stream");
    assert_eq!(
        shape(&msgs),
        "S R Ix456 E S Ix456 E S Ix456 E A S R U D Y R I M R T E c"
    );
    let Message::StreamAbort(abort) = &msgs[1375] else {
        panic!()
    };
    assert_eq!(
        (abort.xid, abort.subtransaction_xid, abort.abort_info),
        (0x312, 0x313, None)
    );
    let Message::StreamCommit(commit) = msgs.last().unwrap() else {
        panic!()
    };
    assert_eq!(commit.xid, 0x312);
    let starts: Vec<bool> = msgs
        .iter()
        .filter_map(|m| match m {
            Message::StreamStart(s) => {
                assert_eq!(s.xid, 0x312);
                Some(s.first_segment)
            }
            _ => None,
        })
        .collect();
    assert_eq!(starts, vec![true, false, false, false]);

    let msgs = decode_capture("v4-parallel");
    assert_eq!(shape(&msgs), "S R Ix456 E S Ix456 E S Ix456 E A c");
    let Message::StreamAbort(abort) = &msgs[1375] else {
        panic!()
    };
    let Message::StreamCommit(commit) = &msgs[1376] else {
        panic!()
    };
    let info = abort.abort_info.unwrap();
    assert_eq!((abort.xid, abort.subtransaction_xid), (0x319, 0x31a));
    assert!(info.abort_lsn <= commit.commit_lsn);
    assert!(info.abort_timestamp <= commit.commit_timestamp);
    // Decoding it as non-parallel fails exactly at the STREAM ABORT.
    let mut tracker = StreamTracker::new(4, false);
    let first_failure = capture("v4-parallel")
        .into_iter()
        .position(|raw| tracker.decode(raw).is_err());
    assert_eq!(first_failure, Some(1375));
}

#[test]
fn capture_two_phase() {
    let msgs = decode_capture("v3-twophase");
    assert_eq!(
        shape(&msgs),
        "b R I P K b I P r S R Ix453 E S Ix452 E S Ix95 E p K"
    );
    let gids: Vec<(u8, &str)> = msgs
        .iter()
        .filter_map(|m| match m {
            Message::BeginPrepare(p) => Some((b'b', p.gid.as_str())),
            Message::Prepare(p) => Some((b'P', p.gid.as_str())),
            Message::CommitPrepared(p) => Some((b'K', p.gid.as_str())),
            Message::RollbackPrepared(p) => Some((b'r', p.gid.as_str())),
            Message::StreamPrepare(p) => Some((b'p', p.gid.as_str())),
            _ => None,
        })
        .collect();
    assert_eq!(
        gids,
        vec![
            (b'b', "mm-gid-1"),
            (b'P', "mm-gid-1"),
            (b'K', "mm-gid-1"),
            (b'b', "mm-gid-2"),
            (b'P', "mm-gid-2"),
            (b'r', "mm-gid-2"),
            (b'p', "mm-gid-3"),
            (b'K', "mm-gid-3"),
        ]
    );
    let (Message::BeginPrepare(begin), Message::Prepare(prepare)) = (&msgs[0], &msgs[3]) else {
        panic!()
    };
    assert_eq!(
        (begin.prepare_lsn, begin.end_lsn, begin.xid),
        (prepare.prepare_lsn, prepare.end_lsn, prepare.xid)
    );
    let Message::RollbackPrepared(rollback) = &msgs[8] else {
        panic!()
    };
    let Message::Prepare(prepare2) = &msgs[7] else {
        panic!()
    };
    assert_eq!(rollback.prepare_end_lsn, prepare2.end_lsn);
    assert_eq!(rollback.prepare_timestamp, prepare2.prepare_timestamp);
}

#[test]
fn capture_binary() {
    let msgs = decode_capture("v2-binary");
    assert_eq!(shape(&msgs), "B Y R I C B U C B D C");
    let Message::Update(update) = &msgs[6] else {
        panic!()
    };
    // numeric 2 in binary: ndigits 1, weight 0, positive, dscale 2, digit 2.
    assert_eq!(update.new.columns[4], b(&[0, 1, 0, 0, 0, 0, 0, 2, 0, 2]));
}

#[test]
fn tracker_state() {
    let mut tracker = StreamTracker::new(2, false);
    assert_eq!(tracker.stream_xid(), None);
    tracker.decode(h("53 00000007 01")).unwrap();
    assert_eq!(tracker.stream_xid(), Some(7));
    assert!(tracker.context().in_stream_block);
    // A failed decode leaves the state alone.
    assert!(tracker.decode(h("53 00000008 01")).is_err());
    assert_eq!(tracker.stream_xid(), Some(7));
    tracker.decode(h("45")).unwrap();
    assert_eq!(tracker.stream_xid(), None);
    assert!(!tracker.context().in_stream_block);
    // Encoding side drives the same state.
    let mut out = BytesMut::new();
    tracker
        .encode(
            &Message::StreamStart(StreamStart {
                xid: 9,
                first_segment: false,
            }),
            &mut out,
        )
        .unwrap();
    assert_eq!(tracker.stream_xid(), Some(9));
}
