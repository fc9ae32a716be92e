//! A trivial container for recorded message streams: each message as a u32
//! big-endian length followed by its bytes, repeated.
//!
//! Used for captures of real PostgreSQL traffic (tests, fuzz seeds) and the
//! decode benchmark's input; not part of any PostgreSQL protocol.

use bytes::{BufMut, Bytes, BytesMut};

/// A framed stream is malformed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("framed stream truncated at offset {offset}: need {needed} bytes, {available} left")]
    Truncated {
        offset: usize,
        needed: u64,
        available: usize,
    },
    #[error("message of {len} bytes is too long for a u32 frame length")]
    TooLong { len: usize },
}

/// Appends one frame holding `message`.
pub fn write_framed(out: &mut BytesMut, message: &[u8]) -> Result<(), FrameError> {
    let len =
        u32::try_from(message.len()).map_err(|_| FrameError::TooLong { len: message.len() })?;
    out.reserve(4 + message.len());
    out.put_u32(len);
    out.put_slice(message);
    Ok(())
}

/// Iterates over the messages of a framed stream; each is a slice of `buf`.
pub fn read_framed(buf: Bytes) -> FramedReader {
    FramedReader {
        buf,
        pos: 0,
        failed: false,
    }
}

/// Iterator returned by [`read_framed`]. Stops after the first error.
#[derive(Debug, Clone)]
pub struct FramedReader {
    buf: Bytes,
    /// Invariant: `pos <= buf.len()`.
    pos: usize,
    failed: bool,
}

impl Iterator for FramedReader {
    type Item = Result<Bytes, FrameError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.pos >= self.buf.len() {
            return None;
        }
        let available = self.buf.len() - self.pos;
        let header: Option<[u8; 4]> = self
            .buf
            .get(self.pos..self.pos + 4.min(available))
            .and_then(|h| h.try_into().ok());
        let Some(header) = header else {
            self.failed = true;
            return Some(Err(FrameError::Truncated {
                offset: self.pos,
                needed: 4,
                available,
            }));
        };
        let len = u32::from_be_bytes(header);
        let start = self.pos + 4;
        let end = usize::try_from(len).ok().and_then(|l| start.checked_add(l));
        match end.filter(|&e| e <= self.buf.len()) {
            Some(end) => {
                self.pos = end;
                Some(Ok(self.buf.slice(start..end)))
            }
            None => {
                self.failed = true;
                Some(Err(FrameError::Truncated {
                    offset: start,
                    needed: len.into(),
                    available: self.buf.len() - start,
                }))
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_truncation() {
        let mut out = BytesMut::new();
        for m in [&b"B..."[..], b"", b"xyz"] {
            write_framed(&mut out, m).unwrap();
        }
        let all = out.freeze();
        let got: Vec<_> = read_framed(all.clone()).collect::<Result<_, _>>().unwrap();
        assert_eq!(
            got,
            vec![
                Bytes::from_static(b"B..."),
                Bytes::new(),
                Bytes::from_static(b"xyz")
            ]
        );
        // Every strict prefix that cuts a frame ends in an error, never a panic.
        let boundaries = [0, 8, 12, all.len()];
        for cut in 0..all.len() {
            let results: Vec<_> = read_framed(all.slice(..cut)).collect();
            let failed = results.iter().any(|r| r.is_err());
            assert_eq!(failed, !boundaries.contains(&cut), "cut at {cut}");
        }
    }
}
