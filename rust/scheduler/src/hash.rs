//! A small, fast, non-cryptographic hasher (the FxHash mixing step) for the maps of
//! the core. Keys are request ids and block-content buckets; neither is attacker-
//! chosen in a way that matters, and exactness never depends on the hash (the
//! prefix cache compares full keys).

use std::hash::{BuildHasherDefault, Hasher};

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

#[derive(Default, Clone, Copy)]
pub struct FxHasher {
    hash: u64,
}

impl FxHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut buf = [0u8; 8];
            buf[..chunk.len()].copy_from_slice(chunk);
            self.add(u64::from_le_bytes(buf));
        }
    }
    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(i as u64);
    }
    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }
    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.hash
    }
}

pub type FxBuildHasher = BuildHasherDefault<FxHasher>;

/// Content bucket of one full block: its parent prefix id and its token ids.
pub fn hash_block(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = FxHasher::default();
    h.add(parent);
    for &t in tokens {
        h.add(t as u64);
    }
    h.finish()
}
