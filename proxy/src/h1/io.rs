//! Reading and writing a TCP socket by shared reference (`&TcpStream`, the
//! readiness API): a server connection and the request body it lends to the
//! handler use one socket without splitting it or taking a lock.
//!
//! A read that returns fewer bytes than it had room for has drained the
//! socket's receive queue, so the socket is marked not readable at once
//! instead of by a second read that fails with `EAGAIN` (nginx does the
//! same). Edge-triggered epoll reports any byte or close that arrives after
//! it, and tokio never clears a close it saw: nothing is missed. That is one
//! system call fewer per message read, two per proxied request.

use std::io::{self, IoSlice};
use std::task::{ready, Context, Poll, Waker};

use bytes::BytesMut;
use tokio::io::Interest;
use tokio::net::TcpStream;

/// Room made in a read buffer before a read, at least.
const READ_CHUNK: usize = 8192;
/// Room made in a read buffer before a read, at most.
const READ_MAX: usize = 1 << 20;

/// How much room to make for the next read of one connection: it doubles
/// when a read fills the room (a large body is read in a few calls, not in
/// 8 KB steps) and halves after two reads that used less than half of it,
/// hyper's adaptive strategy.
#[derive(Debug, Clone, Copy)]
pub struct ReadSize {
    next: usize,
    low: bool,
}

impl Default for ReadSize {
    fn default() -> Self {
        Self {
            next: READ_CHUNK,
            low: false,
        }
    }
}

impl ReadSize {
    fn record(&mut self, n: usize, room: usize) {
        if n >= room {
            self.next = (self.next * 2).min(READ_MAX);
            self.low = false;
        } else if n < self.next / 2 {
            if self.low {
                self.next = (self.next / 2).max(READ_CHUNK);
            }
            self.low = !self.low;
        } else {
            self.low = false;
        }
    }
}

/// Reads what the socket has into `buf` (0: the peer closed).
pub fn poll_read(
    io: &TcpStream,
    buf: &mut BytesMut,
    size: &mut ReadSize,
    cx: &mut Context<'_>,
) -> Poll<io::Result<usize>> {
    if buf.capacity() - buf.len() < size.next / 2 {
        buf.reserve(size.next);
    }
    loop {
        ready!(io.poll_read_ready(cx))?;
        let room = buf.capacity() - buf.len();
        match io.try_read_buf(buf) {
            Ok(n) => {
                if n > 0 && n < room {
                    drained(io);
                }
                size.record(n, room);
                return Poll::Ready(Ok(n));
            }
            // Readiness was stale and is now cleared: wait for the next.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Poll::Ready(Err(e)),
        }
    }
}

/// Reads what the socket has into `buf`, waiting for it (0: the peer closed).
pub async fn read(io: &TcpStream, buf: &mut BytesMut, size: &mut ReadSize) -> io::Result<usize> {
    std::future::poll_fn(|cx| poll_read(io, buf, size, cx)).await
}

/// Marks the socket not readable after a read that drained it.
fn drained(io: &TcpStream) {
    let _ = io.try_io(Interest::READABLE, || {
        Err::<(), _>(io::ErrorKind::WouldBlock.into())
    });
}

/// Writes `parts` in order, whole, with as few system calls as the socket
/// allows (one `writev` when it takes them all).
pub async fn write_all(io: &TcpStream, parts: &mut [&[u8]]) -> io::Result<()> {
    write_counted(io, parts, &mut 0).await
}

/// [`write_all`], adding to `written` the bytes the socket took (a caller
/// that may retry elsewhere needs to know whether any did).
pub async fn write_counted(
    io: &TcpStream,
    parts: &mut [&[u8]],
    written: &mut usize,
) -> io::Result<()> {
    loop {
        let mut slices = [IoSlice::new(&[]); 4];
        let mut n = 0;
        for p in parts.iter().filter(|p| !p.is_empty()) {
            if n == slices.len() {
                break;
            }
            slices[n] = IoSlice::new(p);
            n += 1;
        }
        if n == 0 {
            return Ok(());
        }
        let r = match n {
            1 => io.try_write(&slices[0]),
            _ => io.try_write_vectored(&slices[..n]),
        };
        match r {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(w) => {
                *written += w;
                advance(parts, w);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => io.writable().await?,
            Err(e) => return Err(e),
        }
    }
}

/// Drops the first `n` bytes of `parts`.
fn advance(parts: &mut [&[u8]], mut n: usize) {
    for p in parts.iter_mut() {
        let k = n.min(p.len());
        *p = &p[k..];
        n -= k;
        if n == 0 {
            return;
        }
    }
}

/// Whether an idle connection is unusable: the peer closed it, or sent
/// bytes nobody asked for. Costs no system call while nothing arrived.
pub fn idle_is_broken(io: &TcpStream) -> bool {
    let mut cx = Context::from_waker(Waker::noop());
    match io.poll_read_ready(&mut cx) {
        Poll::Pending => false,
        Poll::Ready(Err(_)) => true,
        Poll::Ready(Ok(())) => {
            let mut byte = [0u8; 1];
            match io.try_read(&mut byte) {
                Err(e) => e.kind() != io::ErrorKind::WouldBlock,
                Ok(_) => true,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpListener;

    use super::*;

    async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (s, _) = l.accept().await.unwrap();
        (c, s)
    }

    #[tokio::test]
    async fn a_drained_read_still_sees_later_bytes_and_the_close() {
        let (mut client, server) = pair().await;
        let mut buf = BytesMut::new();
        client.write_all(b"first").await.unwrap();
        assert_eq!(
            read(&server, &mut buf, &mut ReadSize::default())
                .await
                .unwrap(),
            5
        );
        // Marked drained; the next bytes wake the reader all the same.
        client.write_all(b"second").await.unwrap();
        assert_eq!(
            read(&server, &mut buf, &mut ReadSize::default())
                .await
                .unwrap(),
            6
        );
        assert_eq!(&buf[..], b"firstsecond");
        // Bytes and the close in one go: the close is not lost either.
        client.write_all(b"last").await.unwrap();
        drop(client);
        let mut got = 0;
        loop {
            match read(&server, &mut buf, &mut ReadSize::default())
                .await
                .unwrap()
            {
                0 => break,
                n => got += n,
            }
        }
        assert_eq!(got, 4);
    }

    #[test]
    fn the_read_size_grows_on_full_reads_and_shrinks_on_small_ones() {
        let mut s = ReadSize::default();
        s.record(READ_CHUNK, READ_CHUNK);
        s.record(2 * READ_CHUNK, 2 * READ_CHUNK);
        assert_eq!(s.next, 4 * READ_CHUNK);
        for _ in 0..64 {
            s.record(READ_MAX, READ_MAX);
        }
        assert_eq!(s.next, READ_MAX);
        s.record(10, READ_MAX);
        assert_eq!(s.next, READ_MAX, "one small read is not a trend");
        s.record(10, READ_MAX);
        assert_eq!(s.next, READ_MAX / 2);
        for _ in 0..64 {
            s.record(10, s.next);
        }
        assert_eq!(s.next, READ_CHUNK);
    }

    #[tokio::test]
    async fn vectored_writes_arrive_whole_and_in_order() {
        let (client, server) = pair().await;
        let big = vec![b'x'; 4 << 20];
        let writer = tokio::spawn(async move {
            write_all(&server, &mut [b"head:", &big, b":tail", b"", b"!"])
                .await
                .unwrap();
        });
        let mut buf = BytesMut::new();
        let want = 5 + (4 << 20) + 5 + 1;
        while buf.len() < want {
            assert!(
                read(&client, &mut buf, &mut ReadSize::default())
                    .await
                    .unwrap()
                    > 0
            );
        }
        writer.await.unwrap();
        assert!(buf.starts_with(b"head:xxx"));
        assert!(buf.ends_with(b"xxx:tail!"));
    }

    /// Polls (bounded) until the idle check calls `io` broken.
    async fn until_broken(io: &TcpStream) -> bool {
        for _ in 0..500 {
            if idle_is_broken(io) {
                return true;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        false
    }

    #[tokio::test]
    async fn an_idle_connection_is_broken_once_closed_or_written_to() {
        let (mut client, server) = pair().await;
        assert!(!idle_is_broken(&server));
        client.write_all(b"?").await.unwrap();
        assert!(until_broken(&server).await, "bytes nobody asked for");
        let (client, server) = pair().await;
        assert!(!idle_is_broken(&server));
        drop(client);
        assert!(until_broken(&server).await, "a close");
    }
}
