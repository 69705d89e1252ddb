//! Key names: every key of one call shares the hash tag of one model's
//! stripe, `{PREFIX:MODEL:STRIPE}`, so the call runs on one cluster slot
//! (the layout is in `functions.lua`).

use kvmesh_filters::prefix::hash::BlockKey;
use xxhash_rust::xxh3::xxh3_64;

/// The hash tag of one model's stripe, braces included.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Tag(String);

impl Tag {
    /// The tag of `model`'s stripe `stripe` under `prefix`. Braces in the
    /// model name would end the tag early, so they are replaced.
    pub fn new(prefix: &str, model: &str, stripe: u16) -> Self {
        let model: String = model
            .chars()
            .map(|c| if c == '{' || c == '}' { '_' } else { c })
            .collect();
        Tag(format!("{{{prefix}:{model}:{stripe}}}"))
    }

    /// The hash of block `key`: who holds it.
    pub fn block(&self, key: BlockKey) -> String {
        format!("{}:b:{key:016x}", self.0)
    }

    /// The hash of approximate block `key` (text chunks, `prefix.tokenizer:
    /// none`): whom routing decisions sent it to, each guess with its expiry.
    pub fn guess(&self, key: BlockKey) -> String {
        format!("{}:a:{key:016x}", self.0)
    }

    /// The members' pod records, each with its lease's expiry.
    pub fn records(&self) -> String {
        format!("{}:recs", self.0)
    }

    /// The set of members registered under this tag.
    pub fn members(&self) -> String {
        format!("{}:members", self.0)
    }

    /// The ring of members by position.
    pub fn ring(&self) -> String {
        format!("{}:ring", self.0)
    }
}

/// Which of `stripes` stripes pod `pod_id` writes to.
pub fn stripe_of(pod_id: &str, stripes: u16) -> u16 {
    (xxh3_64(pod_id.as_bytes()) % u64::from(stripes.max(1))) as u16
}

/// A member's position on the prefix ring: 52 bits of its id's hash, as
/// `functions.lua` reads a block key's (exact in a Lua number).
pub fn ring_pos(member: &str) -> u64 {
    xxh3_64(member.as_bytes()) >> 12
}

/// A fresh member id: 48 random bits in hex. Random rather than counted so
/// that a replica promoted before it saw a registration cannot hand the
/// same id out twice.
pub fn new_member() -> String {
    format!("{:012x}", rand::random::<u64>() >> 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_tag_per_stripe_and_braces_cannot_end_it() {
        let t = Tag::new("kvmesh", "Qwen/Qwen3-32B", 3);
        assert_eq!(
            t.block(0xab),
            "{kvmesh:Qwen/Qwen3-32B:3}:b:00000000000000ab"
        );
        assert_eq!(t.members(), "{kvmesh:Qwen/Qwen3-32B:3}:members");
        assert_eq!(
            t.guess(0xab),
            "{kvmesh:Qwen/Qwen3-32B:3}:a:00000000000000ab"
        );
        assert_eq!(t.records(), "{kvmesh:Qwen/Qwen3-32B:3}:recs");
        assert_eq!(Tag::new("p", "a}b{", 0).ring(), "{p:a_b_:0}:ring");
    }

    #[test]
    fn the_ring_position_is_what_lua_reads_off_a_block_name() {
        // functions.lua: tonumber(string.sub(name, -16, -4), 16), the first
        // 13 hex digits of the block key.
        let key: BlockKey = 0x0123_4567_89ab_cdef;
        let name = Tag::new("p", "m", 0).block(key);
        let lua = u64::from_str_radix(&name[name.len() - 16..name.len() - 3], 16).unwrap();
        assert_eq!(lua, key >> 12);
        assert!(ring_pos("member") < 1 << 52);
        assert_eq!(stripe_of("pod", 1), 0);
        assert!(stripe_of("pod", 7) < 7);
        assert_eq!(new_member().len(), 12);
    }
}
