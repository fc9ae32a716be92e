//! The socket options the standard library and tokio do not set: the
//! receive low-water mark and the receive buffer. The workspace denies
//! `unsafe`; this module is its one exception, one FFI call on a socket the
//! caller owns.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::RawFd;

/// Sets `SO_RCVLOWAT`: a TCP socket then reports readable (and wakes its
/// reader) only once `bytes` are buffered. Lowering it signals readability
/// at once when that much is already there (Linux `tcp_set_rcvlowat`).
pub(crate) fn set_rcvlowat(fd: RawFd, bytes: usize) -> io::Result<()> {
    set_int(fd, libc::SO_RCVLOWAT, bytes)
}

/// Sets `SO_RCVBUF`, which also turns the kernel's receive-buffer
/// autotuning off for this socket (Linux doubles the value for its own
/// bookkeeping).
pub(crate) fn set_rcvbuf(fd: RawFd, bytes: usize) -> io::Result<()> {
    set_int(fd, libc::SO_RCVBUF, bytes)
}

fn set_int(fd: RawFd, option: libc::c_int, bytes: usize) -> io::Result<()> {
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
            option,
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

/// `SO_RCVBUF` as the kernel reports it (doubled from what was set).
#[cfg(test)]
pub(crate) fn rcvbuf(fd: RawFd) -> io::Result<usize> {
    let mut value: libc::c_int = 0;
    let mut len = libc::socklen_t::try_from(std::mem::size_of::<libc::c_int>())
        .map_err(|_| io::Error::other("socklen_t overflow"))?;
    // SAFETY: `fd` is an open socket owned by the caller; value and len
    // point to live locals of the sizes the kernel writes.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&raw mut value).cast::<libc::c_void>(),
            &raw mut len,
        )
    };
    if rc == 0 {
        usize::try_from(value).map_err(|_| io::Error::other("negative SO_RCVBUF"))
    } else {
        Err(io::Error::last_os_error())
    }
}
