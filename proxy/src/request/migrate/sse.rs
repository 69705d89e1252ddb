//! SSE framing, as the migrating relay reads and writes it: where an event
//! ends, its data, one event written.

use bytes::Bytes;

/// The data of one SSE event (its `data:` lines joined), `None` if it has none.
pub(super) fn data_of(ev: &[u8]) -> Option<Vec<u8>> {
    let mut out: Option<Vec<u8>> = None;
    for line in ev.split(|b| *b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(rest) = line.strip_prefix(b"data:") else {
            continue;
        };
        let rest = rest.strip_prefix(b" ").unwrap_or(rest);
        match out.as_mut() {
            Some(o) => {
                o.push(b'\n');
                o.extend_from_slice(rest);
            }
            None => out = Some(rest.to_vec()),
        }
    }
    out
}

/// `data: {json}` as one event.
pub(super) fn sse_event(json: &[u8]) -> Bytes {
    let mut b = Vec::with_capacity(json.len() + 8);
    b.extend_from_slice(b"data: ");
    b.extend_from_slice(json);
    b.extend_from_slice(b"\n\n");
    Bytes::from(b)
}

/// Where the first event in `b` ends (just past its blank line).
pub(super) fn event_end(b: &[u8]) -> Option<usize> {
    let lf = b.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    let crlf = b.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4);
    match (lf, crlf) {
        (Some(a), Some(c)) => Some(a.min(c)),
        (a, c) => a.or(c),
    }
}

pub(super) fn ends_event(b: &[u8]) -> bool {
    b.ends_with(b"\n\n") || b.ends_with(b"\r\n\r\n")
}
