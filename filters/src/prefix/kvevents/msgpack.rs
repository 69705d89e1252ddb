//! A bounded, zero-copy msgpack reader for untrusted KV event payloads.
//!
//! It never recurses on its own (skipping a value keeps a counter of values
//! still to skip), never trusts a length (an array or map may not claim more
//! elements than bytes remain, a string not more bytes than remain), and
//! reports every problem as a [`DecodeError`], so random bytes cannot make it
//! panic, loop or allocate beyond a small multiple of the input size.

use super::DecodeError;

/// One msgpack head. Strings and binaries carry their bytes; arrays and maps
/// carry their (validated) element counts and must be read element by element.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Item<'a> {
    Nil,
    Bool(bool),
    /// Any non-negative integer.
    Uint(u64),
    /// A negative integer.
    Neg(i64),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(usize),
    Map(usize),
    Ext,
}

impl Item<'_> {
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Item::Nil => "nil",
            Item::Bool(_) => "bool",
            Item::Uint(_) | Item::Neg(_) => "int",
            Item::Float(_) => "float",
            Item::Str(_) => "str",
            Item::Bin(_) => "bin",
            Item::Array(_) => "array",
            Item::Map(_) => "map",
            Item::Ext => "ext",
        }
    }
}

/// A cursor over one payload.
#[derive(Debug)]
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if n > self.remaining() {
            return Err(DecodeError::Truncated);
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn be(&mut self, n: usize) -> Result<u64, DecodeError> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    }

    fn len(&mut self, n: usize) -> Result<usize, DecodeError> {
        usize::try_from(self.be(n)?).map_err(|_| DecodeError::TooLong)
    }

    /// A container may not claim more elements than bytes remain (every
    /// element takes at least one byte), which caps any allocation sized by it.
    fn container(&mut self, elems: usize, per: usize) -> Result<usize, DecodeError> {
        match elems.checked_mul(per) {
            Some(need) if need <= self.remaining() => Ok(elems),
            _ => Err(DecodeError::TooLong),
        }
    }

    /// Reads the next head (and a string's or binary's bytes).
    pub(crate) fn next(&mut self) -> Result<Item<'a>, DecodeError> {
        let m = self.take(1)?[0];
        Ok(match m {
            0x00..=0x7f => Item::Uint(u64::from(m)),
            0x80..=0x8f => Item::Map(self.container(usize::from(m & 0x0f), 2)?),
            0x90..=0x9f => Item::Array(self.container(usize::from(m & 0x0f), 1)?),
            0xa0..=0xbf => Item::Str(self.take(usize::from(m & 0x1f))?),
            0xc0 => Item::Nil,
            0xc2 => Item::Bool(false),
            0xc3 => Item::Bool(true),
            0xc4 => {
                let n = self.len(1)?;
                Item::Bin(self.take(n)?)
            }
            0xc5 => {
                let n = self.len(2)?;
                Item::Bin(self.take(n)?)
            }
            0xc6 => {
                let n = self.len(4)?;
                Item::Bin(self.take(n)?)
            }
            0xc7..=0xc9 => {
                let n = self.len(1 << (m - 0xc7))?;
                self.take(n + 1)?;
                Item::Ext
            }
            0xca => Item::Float(f64::from(f32::from_bits(self.be(4)? as u32))),
            0xcb => Item::Float(f64::from_bits(self.be(8)?)),
            0xcc => Item::Uint(self.be(1)?),
            0xcd => Item::Uint(self.be(2)?),
            0xce => Item::Uint(self.be(4)?),
            0xcf => Item::Uint(self.be(8)?),
            0xd0 => int(i64::from(self.be(1)? as u8 as i8)),
            0xd1 => int(i64::from(self.be(2)? as u16 as i16)),
            0xd2 => int(i64::from(self.be(4)? as u32 as i32)),
            0xd3 => int(self.be(8)? as i64),
            0xd4..=0xd8 => {
                self.take((1usize << (m - 0xd4)) + 1)?;
                Item::Ext
            }
            0xd9 => {
                let n = self.len(1)?;
                Item::Str(self.take(n)?)
            }
            0xda => {
                let n = self.len(2)?;
                Item::Str(self.take(n)?)
            }
            0xdb => {
                let n = self.len(4)?;
                Item::Str(self.take(n)?)
            }
            0xdc => {
                let n = self.len(2)?;
                Item::Array(self.container(n, 1)?)
            }
            0xdd => {
                let n = self.len(4)?;
                Item::Array(self.container(n, 1)?)
            }
            0xde => {
                let n = self.len(2)?;
                Item::Map(self.container(n, 2)?)
            }
            0xdf => {
                let n = self.len(4)?;
                Item::Map(self.container(n, 2)?)
            }
            0xe0..=0xff => Item::Neg(i64::from(m as i8)),
            // 0xc1 is never used by msgpack.
            _ => {
                return Err(DecodeError::Type {
                    field: "value",
                    found: "reserved marker",
                })
            }
        })
    }

    /// Skips the rest of a value whose head was `item`.
    pub(crate) fn skip_rest(&mut self, item: Item<'a>) -> Result<(), DecodeError> {
        let mut pending: usize = match item {
            Item::Array(n) => n,
            Item::Map(n) => 2 * n,
            _ => 0,
        };
        while pending > 0 {
            pending -= 1;
            match self.next()? {
                Item::Array(n) => pending += n,
                Item::Map(n) => pending += 2 * n,
                _ => {}
            }
        }
        Ok(())
    }

    /// Skips one whole value.
    pub(crate) fn skip(&mut self) -> Result<(), DecodeError> {
        let item = self.next()?;
        self.skip_rest(item)
    }
}

fn int(v: i64) -> Item<'static> {
    match u64::try_from(v) {
        Ok(u) => Item::Uint(u),
        Err(_) => Item::Neg(v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_heads_and_rejects_lying_lengths() {
        let mut r = Reader::new(&[0x92, 0xcf, 0, 0, 0, 0, 0, 0, 1, 0, 0xff, 0xa2, b'h', b'i']);
        assert_eq!(r.next().unwrap(), Item::Array(2));
        assert_eq!(r.next().unwrap(), Item::Uint(256));
        assert_eq!(r.next().unwrap(), Item::Neg(-1));
        assert_eq!(r.next().unwrap(), Item::Str(b"hi"));
        assert!(matches!(
            Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff]).next(),
            Err(DecodeError::TooLong)
        ));
        assert!(matches!(
            Reader::new(&[0xdb, 0, 0, 0, 9, 1]).next(),
            Err(DecodeError::Truncated)
        ));
        assert!(matches!(
            Reader::new(&[0xd3, 1]).next(),
            Err(DecodeError::Truncated)
        ));
        // A signed marker holding a non-negative value reads as an unsigned int.
        assert_eq!(Reader::new(&[0xd0, 5]).next().unwrap(), Item::Uint(5));
    }

    #[test]
    fn skips_nested_values_without_recursion() {
        let mut deep = vec![0x91; 100_000];
        deep.push(0xc0);
        deep.push(0x07);
        let mut r = Reader::new(&deep);
        r.skip().unwrap();
        assert_eq!(r.next().unwrap(), Item::Uint(7));
    }
}
