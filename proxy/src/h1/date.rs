//! The `Date` header every response carries (RFC 9110 §6.6.1), formatted
//! once a second per serving thread rather than per response.

use std::cell::RefCell;
use std::time::{SystemTime, UNIX_EPOCH};

/// An IMF-fixdate is always this long: `Sun, 06 Nov 1994 08:49:37 GMT`.
const LEN: usize = 29;

struct Cached {
    second: u64,
    text: [u8; LEN],
}

thread_local! {
    static CACHED: RefCell<Option<Cached>> = const { RefCell::new(None) };
}

/// Appends the current date.
pub fn write(out: &mut Vec<u8>) {
    let now = SystemTime::now();
    let second = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    CACHED.with(|c| {
        let mut c = c.borrow_mut();
        let cached = match c.as_mut() {
            Some(x) if x.second == second => x,
            _ => c.insert(Cached {
                second,
                text: format(now),
            }),
        };
        out.extend_from_slice(&cached.text);
    });
}

fn format(at: SystemTime) -> [u8; LEN] {
    let mut text = [b' '; LEN];
    let s = httpdate::fmt_http_date(at);
    let n = s.len().min(LEN);
    text[..n].copy_from_slice(&s.as_bytes()[..n]);
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_date_is_an_imf_fixdate_of_now() {
        let mut out = Vec::new();
        write(&mut out);
        let text = String::from_utf8(out).unwrap();
        assert_eq!(text.len(), LEN);
        let parsed = httpdate::parse_http_date(&text).unwrap();
        let age = SystemTime::now().duration_since(parsed).unwrap_or_default();
        assert!(age.as_secs() <= 2, "{text}");
    }
}
