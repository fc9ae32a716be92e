//! Decoder throughput on a recorded message stream.
//!
//! Input: a framed file (u32 big-endian length + pgoutput message, repeated),
//! e.g. a capture from `proto/fuzz/capture-pg18.sh` or one made by
//! `--generate`. Decodes the whole stream `--iterations` times through a
//! `StreamTracker`, the way the agent does, and prints messages/s and MB/s.
//!
//! ```text
//! cargo run -p mm-proto --release --example decode_bench -- proto/fuzz/captures/v2-stream.framed --protocol 2
//! cargo run -p mm-proto --release --example decode_bench -- --generate /tmp/synthetic.framed --transactions 100000
//! cargo run -p mm-proto --release --example decode_bench -- /tmp/synthetic.framed --iterations 5
//! ```

use std::error::Error;
use std::hint::black_box;
use std::process::ExitCode;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use mm_proto::Lsn;
use mm_proto::pgoutput::{
    Begin, ColumnValue, Commit, Delete, Insert, KeyTuple, Message, OldTuple, PgTimestamp, Relation,
    RelationColumn, ReplicaIdentity, StreamTracker, TupleData, Update, read_framed, write_framed,
};

type Result<T> = std::result::Result<T, Box<dyn Error>>;

struct Args {
    input: Option<String>,
    generate: Option<String>,
    iterations: u32,
    protocol: u8,
    parallel: bool,
    transactions: u32,
    columns: u16,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        input: None,
        generate: None,
        iterations: 10,
        protocol: 4,
        parallel: false,
        transactions: 100_000,
        columns: 8,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--iterations" => args.iterations = value("--iterations")?.parse()?,
            "--protocol" => args.protocol = value("--protocol")?.parse()?,
            "--parallel" => args.parallel = true,
            "--generate" => args.generate = Some(value("--generate")?),
            "--transactions" => args.transactions = value("--transactions")?.parse()?,
            "--columns" => args.columns = value("--columns")?.parse()?,
            "-h" | "--help" => {
                return Err("usage: decode_bench FILE [--iterations N] [--protocol 1-4] [--parallel]\n       \
                     decode_bench --generate FILE [--transactions N] [--columns C]"
                    .into());
            }
            s if s.starts_with('-') => return Err(format!("unknown option {s}").into()),
            s => args.input = Some(s.to_owned()),
        }
    }
    Ok(args)
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("decode_bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let args = parse_args()?;
    if let Some(path) = &args.generate {
        return generate(path, args.transactions, args.columns);
    }
    let path = args.input.as_deref().ok_or("no input file (see --help)")?;
    let data = Bytes::from(std::fs::read(path).map_err(|e| format!("reading {path}: {e}"))?);
    let frames: Vec<Bytes> = read_framed(data)
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| format!("{path} is not a framed message stream: {e}"))?;
    let bytes_per_pass: usize = frames.iter().map(Bytes::len).sum();

    // One checked pass first, so a wrong --protocol/--parallel fails loudly
    // instead of benchmarking error paths.
    let mut tracker = StreamTracker::new(args.protocol, args.parallel);
    for (i, frame) in frames.iter().enumerate() {
        tracker.decode(frame.clone()).map_err(|e| {
            format!(
                "message #{i} does not decode with --protocol {} (parallel: {}): {e}",
                args.protocol, args.parallel
            )
        })?;
    }

    let start = Instant::now();
    for _ in 0..args.iterations {
        let mut tracker = StreamTracker::new(args.protocol, args.parallel);
        for frame in &frames {
            // Cloning a Bytes is a refcount bump: the agent also owns each
            // message buffer it decodes.
            black_box(tracker.decode(black_box(frame.clone())))?;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let messages = frames.len() as f64 * f64::from(args.iterations);
    let megabytes = bytes_per_pass as f64 * f64::from(args.iterations) / 1e6;
    println!(
        "{path}: {} messages, {bytes_per_pass} bytes per pass, {} passes in {secs:.3}s",
        frames.len(),
        args.iterations
    );
    println!(
        "decode: {:.0} messages/s, {:.1} MB/s, {:.0} ns/message",
        messages / secs,
        megabytes / secs,
        secs * 1e9 / messages
    );
    Ok(())
}

/// Writes a synthetic OLTP-like stream (protocol 4, not streamed): per
/// transaction BEGIN, INSERT, UPDATE, UPDATE with key change, DELETE, COMMIT
/// on one table with `columns` text columns of realistic sizes.
fn generate(path: &str, transactions: u32, columns: u16) -> Result<()> {
    let columns = columns.max(1);
    let relation = Relation {
        xid: None,
        oid: 16_384,
        namespace: "public".into(),
        name: "accounts".into(),
        replica_identity: ReplicaIdentity::Default,
        columns: (0..columns)
            .map(|i| RelationColumn {
                is_key: i == 0,
                name: format!("col{i}"),
                type_oid: if i == 0 { 20 } else { 25 },
                type_modifier: -1,
            })
            .collect(),
    };
    let row = |id: u32, version: u32| TupleData {
        columns: (0..columns)
            .map(|i| match i {
                0 => ColumnValue::Text(Bytes::from(id.to_string())),
                // A NULL and an unchanged TOAST value now and then.
                3 if id.is_multiple_of(5) => ColumnValue::Null,
                4 if version > 0 => ColumnValue::UnchangedToast,
                _ => ColumnValue::Text(Bytes::from(format!("value-{id}-{version}-{i:>12}"))),
            })
            .collect(),
    };
    let mut tracker = StreamTracker::new(4, false);
    let mut message = BytesMut::new();
    let mut out = BytesMut::new();
    let mut emit = |msg: &Message, out: &mut BytesMut| -> Result<()> {
        message.clear();
        tracker.encode(msg, &mut message)?;
        write_framed(out, &message)?;
        Ok(())
    };
    let mut lsn = 0x0100_0000u64;
    for t in 0..transactions {
        let ts = PgTimestamp(849_283_200_000_000 + i64::from(t) * 1000);
        lsn += 0x200;
        emit(
            &Message::Begin(Begin {
                final_lsn: Lsn(lsn),
                commit_timestamp: ts,
                xid: 1000 + t,
            }),
            &mut out,
        )?;
        if t == 0 {
            emit(&Message::Relation(relation.clone()), &mut out)?;
        }
        let old = row(t, 0);
        let key = KeyTuple::from_row(&relation, &old)?;
        for msg in [
            Message::Insert(Insert {
                xid: None,
                relation_oid: relation.oid,
                new: old.clone(),
            }),
            Message::Update(Update {
                xid: None,
                relation_oid: relation.oid,
                old: None,
                new: row(t, 1),
            }),
            Message::Update(Update {
                xid: None,
                relation_oid: relation.oid,
                old: Some(OldTuple::Key(key.clone())),
                new: row(t + transactions, 2),
            }),
            Message::Delete(Delete {
                xid: None,
                relation_oid: relation.oid,
                old: OldTuple::Key(key),
            }),
            Message::Commit(Commit {
                commit_lsn: Lsn(lsn),
                end_lsn: Lsn(lsn + 0x30),
                commit_timestamp: ts,
            }),
        ] {
            emit(&msg, &mut out)?;
        }
    }
    std::fs::write(path, &out).map_err(|e| format!("writing {path}: {e}"))?;
    println!(
        "wrote {path}: {} transactions, {} bytes (decode with --protocol 4)",
        transactions,
        out.len()
    );
    Ok(())
}
