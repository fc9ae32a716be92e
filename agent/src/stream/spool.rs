//! On-disk spool for transactions the publisher streams before they commit.
//!
//! With `streaming 'on'` the publisher sends a large transaction in chunks while
//! it is still running. Its commit timestamp — which last-writer-wins needs —
//! and its fate (commit or abort) are only known at STREAM COMMIT/ABORT, so
//! chunks go to a file and are applied at commit: memory stays bounded by the
//! read/write buffers whatever the transaction size, and the transfer overlaps
//! the publisher's own run time instead of adding to the peer's visibility
//! delay. Files are per top-level xid; subtransaction aborts truncate the file
//! back to where that subtransaction began (a subtransaction always ends before
//! its parent writes again, so its changes form one contiguous tail).
//!
//! Transactions sent whole after their commit (not streamed) use it too once
//! they outgrow `stream::SPILL_AT`: their messages are applied at COMMIT and
//! kept until they commit here, for a second, careful pass after a conflict,
//! so without the spool a big one was held in memory whole (1M rows: ~1.7 GB
//! of decoded messages). Their messages carry no xid (`streamed: false`).
//!
//! Spool files never survive a restart: the slot still holds every transaction
//! whose commit we have not confirmed, and the publisher re-sends it whole.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use bytes::Bytes;
use mm_proto::pgoutput::{DecodeContext, Message, decode};

use crate::apply::{ApplyFailure, ChangeSource};

struct SpoolFile {
    path: PathBuf,
    writer: BufWriter<File>,
    len: u64,
    /// (subtransaction xid, file offset of its first change), in start order.
    subxacts: Vec<(u32, u64)>,
    /// Messages of a streamed transaction (each carries its xid), or of one
    /// sent whole after commit (none does).
    streamed: bool,
}

pub struct Spool {
    dir: PathBuf,
    open: HashMap<u32, SpoolFile>,
}

impl Spool {
    /// Opens the spool directory, discarding files left by a previous run.
    pub fn open(dir: &Path) -> io::Result<Spool> {
        if dir.exists() {
            std::fs::remove_dir_all(dir)?;
        }
        std::fs::create_dir_all(dir)?;
        Ok(Spool {
            dir: dir.to_owned(),
            open: HashMap::new(),
        })
    }

    /// Appends one raw pgoutput message of top-level transaction `xid`; `subxid`
    /// is the xid the message carries (a subtransaction's or `xid` itself).
    pub fn append(&mut self, xid: u32, subxid: u32, raw: &[u8]) -> io::Result<()> {
        self.append_as(xid, subxid, raw, true)
    }

    /// Appends one raw message of a transaction sent whole after its commit.
    pub fn append_committed(&mut self, xid: u32, raw: &[u8]) -> io::Result<()> {
        self.append_as(xid, xid, raw, false)
    }

    fn append_as(&mut self, xid: u32, subxid: u32, raw: &[u8], streamed: bool) -> io::Result<()> {
        let f = match self.open.get_mut(&xid) {
            Some(f) => f,
            None => {
                let path = self.dir.join(format!("{xid}.spool"));
                let file = OpenOptions::new()
                    .create(true)
                    .truncate(true)
                    .read(true)
                    .write(true)
                    .open(&path)?;
                self.open.entry(xid).or_insert(SpoolFile {
                    path,
                    writer: BufWriter::with_capacity(1 << 20, file),
                    len: 0,
                    subxacts: Vec::new(),
                    streamed,
                })
            }
        };
        if subxid != xid && !f.subxacts.iter().any(|(s, _)| *s == subxid) {
            f.subxacts.push((subxid, f.len));
        }
        let len = u32::try_from(raw.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "message over 4 GiB"))?;
        f.writer.write_all(&len.to_be_bytes())?;
        f.writer.write_all(raw)?;
        f.len += 4 + u64::from(len);
        Ok(())
    }

    /// STREAM ABORT: the whole transaction (`subxid == xid`) or one
    /// subtransaction. True when it discarded messages received.
    pub fn abort(&mut self, xid: u32, subxid: u32) -> io::Result<bool> {
        if subxid == xid {
            if let Some(f) = self.open.remove(&xid) {
                drop(f.writer);
                std::fs::remove_file(&f.path)?;
                return Ok(true);
            }
            return Ok(false);
        }
        let Some(f) = self.open.get_mut(&xid) else {
            return Ok(false);
        };
        let Some(pos) = f.subxacts.iter().position(|(s, _)| *s == subxid) else {
            // The subtransaction made no changes we received.
            return Ok(false);
        };
        let offset = f.subxacts[pos].1;
        f.subxacts.truncate(pos);
        f.writer.flush()?;
        f.writer.get_ref().set_len(offset)?;
        f.writer.get_mut().sync_data().ok();
        use std::io::Seek;
        f.writer.get_mut().seek(io::SeekFrom::Start(offset))?;
        f.len = offset;
        Ok(true)
    }

    /// How many streamed transactions have chunks here and no end yet.
    pub fn streams_open(&self) -> usize {
        self.open.values().filter(|f| f.streamed).count()
    }

    /// STREAM COMMIT: hands out the transaction's changes for applying. `None`
    /// when nothing was spooled (an empty streamed transaction).
    pub fn take(&mut self, xid: u32) -> io::Result<Option<SpooledTxn>> {
        let Some(f) = self.open.remove(&xid) else {
            return Ok(None);
        };
        let SpoolFile {
            path,
            writer,
            len,
            streamed,
            ..
        } = f;
        let file = writer.into_inner().map_err(|e| e.into_error())?;
        drop(file);
        Ok(Some(SpooledTxn {
            path,
            len,
            streamed,
        }))
    }
}

/// A committed streamed transaction on disk. It can be read more than once
/// (a transaction that meets a conflict is applied again with the resolver);
/// the file is removed when the last handle is dropped, i.e. once the
/// transaction is committed locally or the stream stops.
#[derive(Debug)]
pub struct SpooledTxn {
    path: PathBuf,
    len: u64,
    streamed: bool,
}

impl SpooledTxn {
    pub fn reader(&self) -> io::Result<SpoolReader> {
        let file = File::open(&self.path)?;
        Ok(SpoolReader {
            reader: BufReader::with_capacity(1 << 20, file.take(self.len)),
            ctx: DecodeContext {
                protocol_version: 4,
                in_stream_block: self.streamed,
                parallel_streaming: false,
            },
        })
    }
}

impl crate::apply::Replayable for SpooledTxn {
    fn open(&self) -> Result<Box<dyn ChangeSource>, ApplyFailure> {
        self.reader()
            .map(|r| Box::new(r) as Box<dyn ChangeSource>)
            .map_err(|e| ApplyFailure::new(None, format!("reopening spooled transaction: {e}")))
    }
}

impl Drop for SpooledTxn {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Reads a committed streamed transaction back, one message at a time.
pub struct SpoolReader {
    reader: BufReader<std::io::Take<File>>,
    ctx: DecodeContext,
}

impl ChangeSource for SpoolReader {
    fn next_message(&mut self) -> Result<Option<Message>, ApplyFailure> {
        let io_err =
            |e: io::Error| ApplyFailure::new(None, format!("reading spooled transaction: {e}"));
        let mut len = [0u8; 4];
        match self.reader.read_exact(&mut len) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(io_err(e)),
        }
        let mut buf = vec![0u8; u32::from_be_bytes(len) as usize];
        self.reader.read_exact(&mut buf).map_err(io_err)?;
        decode(Bytes::from(buf), &self.ctx)
            .map(Some)
            .map_err(|e| ApplyFailure::new(None, format!("decoding spooled message: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mm_proto::pgoutput::{ColumnValue, Insert, TupleData, encode_to_bytes};

    fn insert(xid: u32, v: &str) -> Bytes {
        let ctx = DecodeContext {
            protocol_version: 4,
            in_stream_block: true,
            parallel_streaming: false,
        };
        let m = Message::Insert(Insert {
            xid: Some(xid),
            relation_oid: 1,
            new: TupleData::new(vec![ColumnValue::Text(Bytes::from(v.to_owned()))]),
        });
        encode_to_bytes(&m, &ctx).unwrap()
    }

    fn read_all(r: &mut SpoolReader) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(m) = r.next_message().unwrap() {
            if let Message::Insert(i) = m
                && let ColumnValue::Text(b) = &i.new.columns[0]
            {
                out.push(String::from_utf8(b.to_vec()).unwrap());
            }
        }
        out
    }

    #[test]
    fn subtransaction_abort_truncates_only_its_changes() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Spool::open(&dir.path().join("sp")).unwrap();
        s.append(10, 10, &insert(10, "a")).unwrap();
        s.append(10, 11, &insert(11, "b")).unwrap();
        s.append(10, 12, &insert(12, "c")).unwrap();
        s.abort(10, 11).unwrap(); // rolls back 11 and its later sibling/child 12
        s.append(10, 10, &insert(10, "d")).unwrap();
        s.append(20, 20, &insert(20, "other")).unwrap();
        s.abort(20, 20).unwrap();
        let t = s.take(10).unwrap().unwrap();
        assert_eq!(read_all(&mut t.reader().unwrap()), vec!["a", "d"]);
        // Readable again (a redo after a conflict), removed with the handle.
        assert_eq!(read_all(&mut t.reader().unwrap()), vec!["a", "d"]);
        assert!(s.take(20).unwrap().is_none());
        let path = t.path.clone();
        drop(t);
        assert!(!path.exists());
    }
}
