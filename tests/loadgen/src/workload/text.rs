//! Prompt text made of words, so that one word is one token under the
//! builtin tokenizer (`kvmesh_filters::prefix::tokenize::Builtin`: a leading
//! space plus a run of at most 12 alphanumeric characters is one piece).
//!
//! Words are built from syllables into a fixed vocabulary (the same on every
//! machine, independent of any seed); a workload's seed only chooses which
//! words follow which.

use rand::{Rng, RngCore};

const ONSETS: [&str; 16] = [
    "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z",
];
const NUCLEI: [&str; 8] = ["a", "e", "i", "o", "u", "ai", "ou", "ea"];

/// Number of distinct words.
pub const VOCAB_WORDS: usize = 4096;

/// The word for an index below [`VOCAB_WORDS`]: two syllables, at most
/// 6 letters, all distinct, always alphanumeric (one builtin token with a leading space).
pub fn word(index: usize) -> String {
    let i = index % VOCAB_WORDS;
    let syl = |k: usize| {
        let mut s = String::with_capacity(3);
        s.push_str(ONSETS[k % 16]);
        s.push_str(NUCLEI[(k / 16) % 8]);
        s
    };
    // Two syllables out of 128 each: distinct for every index below 4096.
    let mut w = syl(i % 128);
    w.push_str(&syl(i / 128));
    w
}

/// Appends `n` random words to `out`, each preceded by a space (the first one
/// too, unless `out` is empty).
pub fn push_words(out: &mut String, rng: &mut impl RngCore, n: usize) {
    out.reserve(n * 7);
    for _ in 0..n {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(&word(rng.random_range(0..VOCAB_WORDS)));
    }
}

/// `n` random words separated by spaces.
pub fn words(rng: &mut impl RngCore, n: usize) -> String {
    let mut s = String::new();
    push_words(&mut s, rng, n);
    s
}

/// Random words filling about `bytes` bytes (for "very long body" prompts).
pub fn words_of_bytes(rng: &mut impl RngCore, bytes: usize) -> String {
    let mut s = String::with_capacity(bytes + 16);
    while s.len() < bytes {
        push_words(&mut s, rng, 1);
    }
    s
}
