//! The one socket option the standard library, tokio and socket2 do not
//! set: the receive low-water mark. The workspace denies `unsafe`; this
//! module is its one exception, one FFI call on a socket the caller owns.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::RawFd;

/// Sets `SO_RCVLOWAT`: a TCP socket then reports readable (and wakes its
/// reader) only once `bytes` are buffered. Lowering it signals readability
/// at once when that much is already there (Linux `tcp_set_rcvlowat`).
pub(crate) fn set_rcvlowat(fd: RawFd, bytes: usize) -> io::Result<()> {
    let value = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    let len = libc::socklen_t::try_from(std::mem::size_of::<libc::c_int>())
        .map_err(|_| io::Error::other("socklen_t overflow"))?;
    // SAFETY: `fd` is an open socket owned by the caller's connection for
    // the duration of the call; the option value points to a live c_int on
    // this stack frame and `len` is its size. setsockopt reads nothing else.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&raw const value).cast::<libc::c_void>(),
            len,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
