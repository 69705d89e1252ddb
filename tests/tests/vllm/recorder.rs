//! A recording TCP relay between the sidecar and vLLM: it forwards both directions unchanged and
//! keeps a copy of what vLLM sent, so a case can check that the body a client received through the
//! sidecar is byte for byte a body vLLM produced, however vLLM happened to group tokens into stream
//! chunks for that request (under load it coalesces several tokens into one event).

use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

/// Bytes kept per connection; the relay keeps forwarding past it but stops recording.
const MAX_RECORDED: usize = 16 << 20;

type Log = Arc<Mutex<Vec<Arc<Mutex<Vec<u8>>>>>>;

/// The relay: point the sidecar's `engine.url` at [`Recorder::url`].
#[derive(Debug)]
pub struct Recorder {
    pub url: String,
    log: Log,
    tasks: JoinSet<()>,
}

impl Recorder {
    /// Listens on a loopback port and relays every connection to `engine` (`host:port`).
    pub async fn start(engine: &str) -> Result<Recorder> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let log: Log = Arc::default();
        let mut tasks = JoinSet::new();
        let engine = engine.to_string();
        let accept_log = log.clone();
        tasks.spawn(async move {
            let mut conns = JoinSet::new();
            while let Ok((inbound, _)) = listener.accept().await {
                let Ok(outbound) = TcpStream::connect(&engine).await else {
                    continue;
                };
                let record = Arc::new(Mutex::new(Vec::new()));
                accept_log.lock().unwrap().push(record.clone());
                conns.spawn(relay(inbound, outbound, record));
            }
        });
        Ok(Recorder { url, log, tasks })
    }

    /// Forgets what was recorded so far (call before the request of interest).
    pub fn clear(&self) {
        for conn in self.log.lock().unwrap().iter() {
            conn.lock().unwrap().clear();
        }
    }

    /// Every complete HTTP response body recorded since the last [`Recorder::clear`], de-chunked.
    pub fn bodies(&self) -> Vec<Vec<u8>> {
        let conns: Vec<_> = self.log.lock().unwrap().clone();
        conns
            .iter()
            .flat_map(|c| split_responses(&c.lock().unwrap()))
            .collect()
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.tasks.abort_all();
    }
}

async fn relay(inbound: TcpStream, outbound: TcpStream, record: Arc<Mutex<Vec<u8>>>) {
    let (mut in_r, mut in_w) = inbound.into_split();
    let (mut out_r, mut out_w) = outbound.into_split();
    let up = async move {
        let _ = tokio::io::copy(&mut in_r, &mut out_w).await;
        let _ = out_w.shutdown().await;
    };
    let down = async move {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match out_r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            {
                let mut r = record.lock().unwrap();
                if r.len() + n <= MAX_RECORDED {
                    r.extend_from_slice(&buf[..n]);
                }
            }
            if in_w.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = in_w.shutdown().await;
    };
    tokio::join!(up, down);
}

/// The bodies of the complete HTTP/1.1 responses in `raw` (one connection's bytes from the server),
/// with chunked transfer coding removed. An incomplete last response is left out.
pub fn split_responses(raw: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut rest = raw;
    while let Some(end) = find(rest, b"\r\n\r\n") {
        let head = String::from_utf8_lossy(&rest[..end]).to_ascii_lowercase();
        let after = &rest[end + 4..];
        let header = |name: &str| {
            head.lines().find_map(|l| {
                l.strip_prefix(name)
                    .map(|v| v.trim_start_matches(':').trim().to_string())
            })
        };
        if header("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
            match dechunk(after) {
                Some((body, used)) => {
                    out.push(body);
                    rest = &after[used..];
                }
                None => break,
            }
        } else {
            let len: usize = header("content-length")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            if after.len() < len {
                break;
            }
            out.push(after[..len].to_vec());
            rest = &after[len..];
        }
    }
    out
}

fn dechunk(mut data: &[u8]) -> Option<(Vec<u8>, usize)> {
    let total = data.len();
    let mut body = Vec::new();
    loop {
        let line_end = find(data, b"\r\n")?;
        let size_text = String::from_utf8_lossy(&data[..line_end]);
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        data = &data[line_end + 2..];
        if size == 0 {
            // No trailers from vLLM: the final CRLF follows.
            let end = find(data, b"\r\n")?;
            data = &data[end + 2..];
            return Some((body, total - data.len()));
        }
        if data.len() < size + 2 {
            return None;
        }
        body.extend_from_slice(&data[..size]);
        data = &data[size + 2..];
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// `host:port` of an `http://host:port` URL.
pub fn authority(url: &str) -> Result<String> {
    url.strip_prefix("http://")
        .map(|s| s.trim_end_matches('/').to_string())
        .context("expected an http:// URL")
}

#[cfg(test)]
mod tests {
    use super::split_responses;

    #[test]
    fn splits_chunked_and_sized_responses() {
        let raw = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n\
            transfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\npart";
        let bodies = split_responses(raw);
        assert_eq!(bodies, vec![b"ok".to_vec(), b"abcde".to_vec()]);
    }
}
