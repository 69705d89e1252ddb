//! Framing of the local API: `u32 big-endian length | UTF-8 JSON object`, at most [`MAX_FRAME`]
//! bytes, with file descriptors (memfds) riding as SCM_RIGHTS ancillary data on the frame's bytes.
//!
//! The reader uses `recvmsg` for every read so it catches descriptors wherever the kernel
//! delivers them, keeps at most [`MAX_PENDING_FDS`] until a `register` takes them, and closes the
//! rest. Between frames a connection may idle; once a frame has started, the rest must arrive
//! within the I/O deadline.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

use tokio::io::Interest;
use tokio::net::UnixStream;

use crate::error::{Error, Result};

/// Largest frame (a send of 65536 block ids fits).
pub const MAX_FRAME: usize = 1 << 20;
/// Most descriptors held for a connection before a `register` takes them.
pub const MAX_PENDING_FDS: usize = 4;
/// The local API version.
pub const VERSION: u32 = 1;

/// Receive bytes and any SCM_RIGHTS descriptors into `fds` (closing those over the bound).
pub fn recv_with_fds(
    fd: RawFd,
    buf: &mut [u8],
    fds: &mut VecDeque<OwnedFd>,
) -> std::io::Result<usize> {
    const SPACE: usize = 256;
    let mut cmsg = [0u64; SPACE / 8];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: zeroed msghdr is valid; we fill the pointers below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cmsg.as_mut_ptr().cast();
    msg.msg_controllen = SPACE as _;
    // SAFETY: msg points at live buffers for the duration of the call.
    let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: walking the control buffer the kernel filled, with the libc macros.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                    / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    let owned = OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i)));
                    if fds.len() < MAX_PENDING_FDS {
                        fds.push_back(owned);
                    }
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok(n as usize)
}

/// Send `data` with `fd` attached (blocking socket).
pub fn send_with_fd(
    sock: BorrowedFd<'_>,
    data: &[u8],
    fd: BorrowedFd<'_>,
) -> std::io::Result<usize> {
    let mut cmsg = [0u64; 8];
    let mut iov = libc::iovec {
        iov_base: data.as_ptr().cast_mut().cast(),
        iov_len: data.len(),
    };
    // SAFETY: zeroed msghdr is valid; pointers set below stay live during the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cmsg.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE is a pure size computation.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as _;
    // SAFETY: the control buffer is large enough for one fd (64 bytes >= CMSG_SPACE(4)).
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>(), fd.as_raw_fd());
    }
    // SAFETY: msg is fully initialised.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Encode a frame.
pub fn encode(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 4);
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(body);
    out
}

/// Reads frames and collects descriptors from one connection.
pub struct FrameReader {
    buf: Vec<u8>,
    /// Descriptors received and not yet taken.
    pub fds: VecDeque<OwnedFd>,
}

impl Default for FrameReader {
    fn default() -> Self {
        Self::new()
    }
}

impl FrameReader {
    /// A reader with an empty buffer.
    pub fn new() -> Self {
        Self {
            buf: Vec::with_capacity(4096),
            fds: VecDeque::new(),
        }
    }

    fn take_frame(&mut self) -> Result<Option<Vec<u8>>> {
        if self.buf.len() < 4 {
            return Ok(None);
        }
        let len = u32::from_be_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]) as usize;
        if len == 0 || len > MAX_FRAME {
            return Err(Error::BadRequest(format!(
                "frame length {len} outside 1..={MAX_FRAME}"
            )));
        }
        if self.buf.len() < 4 + len {
            return Ok(None);
        }
        let frame = self.buf[4..4 + len].to_vec();
        self.buf.drain(..4 + len);
        Ok(Some(frame))
    }

    /// The next frame; `Ok(None)` when the peer closed between frames.
    pub async fn next(&mut self, stream: &UnixStream, io: Duration) -> Result<Option<Vec<u8>>> {
        let mut chunk = vec![0u8; 64 * 1024];
        loop {
            if let Some(f) = self.take_frame()? {
                return Ok(Some(f));
            }
            let mid_frame = !self.buf.is_empty();
            let fds = &mut self.fds;
            let read = stream.async_io(Interest::READABLE, || {
                recv_with_fds(stream.as_raw_fd(), &mut chunk, fds)
            });
            let n = if mid_frame {
                tokio::time::timeout(io, read)
                    .await
                    .map_err(|_| Error::Timeout("rest of a frame".into()))??
            } else {
                read.await?
            };
            if n == 0 {
                if mid_frame {
                    return Err(Error::BadRequest("connection closed mid-frame".into()));
                }
                return Ok(None);
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}
