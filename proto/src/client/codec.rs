//! Backend message framing and the few message bodies the client reads.
//!
//! Parsed by hand instead of with `postgres_protocol::message::backend`
//! because that parser does not know CopyBothResponse ('W'), the one message
//! that starts streaming. Sans-I/O: frames come out of a `BytesMut` that the
//! connection fills.

use bytes::{Buf, Bytes, BytesMut};

use super::ClientError;

/// Largest frame we accept. PostgreSQL caps a single datum at 1 GiB, so a
/// pgoutput message can exceed 1 GiB only slightly; a larger length is a
/// corrupt stream, and must not make us allocate gigabytes.
pub(crate) const MAX_FRAME_LEN: usize = (1 << 30) + (64 << 20);

/// One backend message: its tag and body (length prefix stripped).
#[derive(Debug, Clone)]
pub(crate) struct Frame {
    pub tag: u8,
    pub body: Bytes,
}

/// Takes one complete frame off the front of `buf`, or reports how many more
/// bytes the frame needs (so the reader can reserve them in one go).
pub(crate) fn take_frame(buf: &mut BytesMut) -> Result<Result<Frame, usize>, ClientError> {
    if buf.len() < 5 {
        return Ok(Err(5 - buf.len()));
    }
    let tag = buf[0];
    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    if len < 4 {
        return Err(ClientError::protocol(format!(
            "message {:?} with length {len} < 4",
            char::from(tag)
        )));
    }
    if len > MAX_FRAME_LEN {
        return Err(ClientError::protocol(format!(
            "message {:?} of {len} bytes exceeds the {MAX_FRAME_LEN}-byte limit",
            char::from(tag)
        )));
    }
    let total = 1 + len;
    if buf.len() < total {
        return Ok(Err(total - buf.len()));
    }
    let mut frame = buf.split_to(total);
    frame.advance(5);
    Ok(Ok(Frame {
        tag,
        body: frame.freeze(),
    }))
}

/// A cursor over a message body whose reads fail, instead of panicking, when
/// the body is shorter than the protocol says.
pub(crate) struct Body<'a> {
    what: &'static str,
    buf: &'a [u8],
}

impl<'a> Body<'a> {
    pub fn new(what: &'static str, buf: &'a [u8]) -> Self {
        Body { what, buf }
    }

    fn short(&self) -> ClientError {
        ClientError::protocol(format!("truncated {} message", self.what))
    }

    pub fn u8(&mut self) -> Result<u8, ClientError> {
        if self.buf.is_empty() {
            return Err(self.short());
        }
        Ok(self.buf.get_u8())
    }

    pub fn i16(&mut self) -> Result<i16, ClientError> {
        if self.buf.len() < 2 {
            return Err(self.short());
        }
        Ok(self.buf.get_i16())
    }

    pub fn i32(&mut self) -> Result<i32, ClientError> {
        if self.buf.len() < 4 {
            return Err(self.short());
        }
        Ok(self.buf.get_i32())
    }

    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], ClientError> {
        if self.buf.len() < n {
            return Err(self.short());
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    /// A NUL-terminated string, decoded lossily: server text is UTF-8 because
    /// we ask for client_encoding=UTF8, and a stray byte in a message must not
    /// turn an error report into a protocol failure.
    pub fn cstr(&mut self) -> Result<String, ClientError> {
        let nul = self.buf.iter().position(|b| *b == 0).ok_or_else(|| {
            ClientError::protocol(format!("unterminated string in {} message", self.what))
        })?;
        let s = String::from_utf8_lossy(&self.buf[..nul]).into_owned();
        self.buf = &self.buf[nul + 1..];
        Ok(s)
    }

    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.buf)
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

/// The fields of an ErrorResponse / NoticeResponse we keep.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ServerFields {
    pub severity: String,
    pub code: String,
    pub message: String,
    pub detail: Option<String>,
    /// The constraint an error is about ('n'), when it names one.
    pub constraint: Option<String>,
}

pub(crate) fn parse_fields(body: &[u8]) -> Result<ServerFields, ClientError> {
    let mut b = Body::new("ErrorResponse", body);
    let mut f = ServerFields::default();
    let mut localized_severity = None;
    loop {
        let kind = b.u8()?;
        if kind == 0 {
            break;
        }
        let value = b.cstr()?;
        match kind {
            b'V' => f.severity = value,
            b'S' => localized_severity = Some(value),
            b'C' => f.code = value,
            b'M' => f.message = value,
            b'D' => f.detail = Some(value),
            b'n' => f.constraint = Some(value),
            _ => {}
        }
    }
    if f.severity.is_empty() {
        f.severity = localized_severity.unwrap_or_else(|| "ERROR".to_owned());
    }
    Ok(f)
}

pub(crate) fn server_error(body: &[u8]) -> ClientError {
    match parse_fields(body) {
        Ok(f) => ClientError::Server {
            severity: f.severity,
            code: f.code,
            message: f.message,
            detail: f.detail,
        },
        Err(e) => e,
    }
}

/// RowDescription: the column names (all columns of the simple protocol are text).
pub(crate) fn parse_row_description(body: &[u8]) -> Result<Vec<String>, ClientError> {
    let mut b = Body::new("RowDescription", body);
    let n = b.i16()?;
    let n = usize::try_from(n)
        .map_err(|_| ClientError::protocol("negative column count in RowDescription"))?;
    let mut names = Vec::with_capacity(n);
    for _ in 0..n {
        names.push(b.cstr()?);
        // table oid, column number, type oid, type size, type modifier, format
        b.bytes(4 + 2 + 4 + 2 + 4 + 2)?;
    }
    Ok(names)
}

/// DataRow in text format: NULL is `None`.
pub(crate) fn parse_data_row(body: &[u8]) -> Result<Vec<Option<String>>, ClientError> {
    let mut b = Body::new("DataRow", body);
    let n = b.i16()?;
    let n = usize::try_from(n)
        .map_err(|_| ClientError::protocol("negative column count in DataRow"))?;
    let mut values = Vec::with_capacity(n);
    for _ in 0..n {
        let len = b.i32()?;
        if len < 0 {
            values.push(None);
        } else {
            let raw = b.bytes(len as usize)?;
            let s = std::str::from_utf8(raw)
                .map_err(|_| ClientError::protocol("DataRow value is not UTF-8"))?;
            values.push(Some(s.to_owned()));
        }
    }
    if !b.is_empty() {
        return Err(ClientError::protocol("trailing bytes in DataRow"));
    }
    Ok(values)
}

/// Human name of a backend tag, for "unexpected message" errors.
pub(crate) fn tag_name(tag: u8) -> &'static str {
    match tag {
        b'R' => "Authentication",
        b'K' => "BackendKeyData",
        b'2' => "BindComplete",
        b'3' => "CloseComplete",
        b'C' => "CommandComplete",
        b'd' => "CopyData",
        b'c' => "CopyDone",
        b'G' => "CopyInResponse",
        b'H' => "CopyOutResponse",
        b'W' => "CopyBothResponse",
        b'D' => "DataRow",
        b'I' => "EmptyQueryResponse",
        b'E' => "ErrorResponse",
        b'v' => "NegotiateProtocolVersion",
        b'n' => "NoData",
        b'N' => "NoticeResponse",
        b'A' => "NotificationResponse",
        b't' => "ParameterDescription",
        b'S' => "ParameterStatus",
        b'1' => "ParseComplete",
        b's' => "PortalSuspended",
        b'Z' => "ReadyForQuery",
        b'T' => "RowDescription",
        _ => "unknown message",
    }
}

pub(crate) fn unexpected(tag: u8, during: &str) -> ClientError {
    ClientError::protocol(format!(
        "unexpected {} ({:?}) {during}",
        tag_name(tag),
        char::from(tag)
    ))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use bytes::BufMut;

    fn frame(tag: u8, body: &[u8]) -> Vec<u8> {
        let mut v = vec![tag];
        v.extend_from_slice(&((body.len() + 4) as u32).to_be_bytes());
        v.extend_from_slice(body);
        v
    }

    #[test]
    fn frames_split_across_reads() {
        let mut all = frame(b'Z', b"I");
        all.extend(frame(b'd', b"hello"));
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        // Feed one byte at a time: every prefix must be "need more", never an error.
        for b in all {
            buf.put_u8(b);
            while let Ok(f) = take_frame(&mut buf).unwrap() {
                got.push((f.tag, f.body));
            }
        }
        assert_eq!(
            got,
            vec![
                (b'Z', Bytes::from_static(b"I")),
                (b'd', Bytes::from_static(b"hello"))
            ]
        );
        assert!(buf.is_empty());
    }

    #[test]
    fn reports_bytes_needed() {
        let mut buf = BytesMut::from(&b"d"[..]);
        assert_eq!(take_frame(&mut buf).unwrap().unwrap_err(), 4);
        let mut buf = BytesMut::from(&frame(b'd', b"abcdef")[..4 + 1 + 2]);
        assert_eq!(take_frame(&mut buf).unwrap().unwrap_err(), 4);
    }

    #[test]
    fn rejects_bad_lengths() {
        let mut buf = BytesMut::from(&[b'd', 0, 0, 0, 3][..]);
        assert!(take_frame(&mut buf).is_err());
        let mut buf = BytesMut::from(&[b'd', 0x7f, 0xff, 0xff, 0xff][..]);
        assert!(take_frame(&mut buf).is_err());
    }

    #[test]
    fn error_fields() {
        let body =
            b"SFEHLER\0VERROR\0C42704\0Mreplication slot \"x\" does not exist\0Dsome detail\0\0";
        match server_error(body) {
            ClientError::Server {
                severity,
                code,
                message,
                detail,
            } => {
                assert_eq!(severity, "ERROR");
                assert_eq!(code, "42704");
                assert_eq!(message, "replication slot \"x\" does not exist");
                assert_eq!(detail.as_deref(), Some("some detail"));
            }
            other => panic!("{other:?}"),
        }
        // Truncated: a protocol error, not a panic.
        assert!(matches!(server_error(b"C4270"), ClientError::Protocol(_)));
    }

    #[test]
    fn rows() {
        let mut body = vec![0, 2];
        body.extend_from_slice(&3i32.to_be_bytes());
        body.extend_from_slice(b"abc");
        body.extend_from_slice(&(-1i32).to_be_bytes());
        assert_eq!(
            parse_data_row(&body).unwrap(),
            vec![Some("abc".to_owned()), None]
        );
        assert!(parse_data_row(&body[..body.len() - 1]).is_err());
        let mut desc = vec![0, 1];
        desc.extend_from_slice(b"slot_name\0");
        desc.extend_from_slice(&[0; 18]);
        assert_eq!(
            parse_row_description(&desc).unwrap(),
            vec!["slot_name".to_owned()]
        );
        assert!(parse_row_description(&desc[..desc.len() - 1]).is_err());
    }
}
