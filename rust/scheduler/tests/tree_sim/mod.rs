//! Test model of the KV cache for the state machine: each slot holds a hash of the
//! token context its KV was computed from (the tokens along the path that reaches
//! it). A forward writes every query token's content from the content of the token
//! it attends to last (the previous position, or the tree parent named by the
//! token's `tree_mask`); `update`'s copy list then moves contents. After every
//! update, each live request's slot position p (p < num_computed) must hold the
//! hash of its tokens [0, p]: the packed positions, slots, masks and the
//! compaction are then all right. Also: random tree proposals and emitted paths
//! that follow the core's lowest-index-child rule.

use std::collections::HashMap;

use specinfer_scheduler::{Scheduler, SchedulerOutput, UpdateOutput};

const SEED: u64 = 0x5eed;

fn mix(ctx: u64, token: i64) -> u64 {
    let x = (ctx ^ (token as u64).wrapping_add(0x9e37_79b9_7f4a_7c15))
        .wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^ (x >> 31)
}

/// Content of position p of a request holding `tokens` (hash of tokens[..=p]).
pub fn expected_contents(tokens: &[u32]) -> Vec<u64> {
    let mut ctx = SEED;
    tokens
        .iter()
        .map(|&t| {
            ctx = mix(ctx, t as i64);
            ctx
        })
        .collect()
}

#[derive(Default)]
pub struct SimKv {
    slots: HashMap<i64, u64>,
}

impl SimKv {
    fn read(&self, slot: i64, what: &str) -> u64 {
        *self
            .slots
            .get(&slot)
            .unwrap_or_else(|| panic!("{what}: slot {slot} read before any write"))
    }

    /// The forward pass over a packed batch, token after token (a query token
    /// attends to earlier tokens of its own run, written just before it).
    pub fn forward(&mut self, out: &SchedulerOutput, block_size: usize) {
        let bs = block_size as i64;
        for seq in 0..out.num_seqs() {
            let row = out.block_table_row(seq);
            let slot = |p: i64| row[(p / bs) as usize] as i64 * bs + p % bs;
            let (q0, q1) = (
                out.query_start_loc[seq] as usize,
                out.query_start_loc[seq + 1] as usize,
            );
            for t in q0..q1 {
                let mask = out.tree_mask.get(t).copied().unwrap_or(0) as u64;
                let prev = if mask == 0 {
                    let pos = out.positions[t];
                    assert_eq!(out.slot_mapping[t], slot(pos));
                    (pos > 0).then(|| slot(pos - 1))
                } else {
                    let start = out.tree_start[seq] as i64;
                    let i = 63 - mask.leading_zeros() as i64; // the token's own node
                    assert!(mask & 1 == 1, "a tree token sees its root");
                    assert_eq!(out.slot_mapping[t], slot(start + i), "node i at root + i");
                    assert_eq!(
                        out.positions[t],
                        start + mask.count_ones() as i64 - 1,
                        "RoPE position = root + depth"
                    );
                    if i == 0 {
                        (start > 0).then(|| slot(start - 1))
                    } else {
                        let up = mask & !(1u64 << i);
                        let parent = 63 - up.leading_zeros() as i64;
                        assert_eq!(
                            out.tree_mask[t - i as usize + parent as usize] as u64,
                            up,
                            "a node's mask is its parent's plus itself"
                        );
                        Some(slot(start + parent))
                    }
                };
                let ctx = prev.map_or(SEED, |s| self.read(s, "context"));
                self.slots
                    .insert(out.slot_mapping[t], mix(ctx, out.input_ids[t]));
            }
        }
    }

    pub fn apply_copies(&mut self, up: &UpdateOutput) {
        for (&src, &dst) in up.kv_copy_src.iter().zip(&up.kv_copy_dst) {
            let v = self.read(src, "copy source");
            self.slots.insert(dst, v);
        }
    }

    /// Every live request's confirmed positions hold their context's content.
    pub fn check(&self, s: &Scheduler, live: &[u64]) {
        let bs = s.config().block_size;
        for &id in live {
            let r = s.request(id).unwrap();
            let want = expected_contents(&r.token_ids);
            // positions in blocks given back under a sliding window are no one's to check
            let dead = r.num_dead_blocks * bs;
            for (p, &w) in want
                .iter()
                .enumerate()
                .take(r.num_computed_tokens)
                .skip(dead)
            {
                let slot = r.block_ids[p / bs] as i64 * bs as i64 + (p % bs) as i64;
                assert_eq!(
                    self.slots.get(&slot),
                    Some(&w),
                    "request {id}: KV of position {p} is not its token's along the path"
                );
            }
        }
    }
}

/// A random accepted path through the first `m` nodes (drafts, parents): at each
/// node stop with probability 1/3 or when it has no child; else pick one of its
/// children's tokens and descend, as the core does, into the lowest-index child
/// with that token. Returns the path's nodes.
pub fn random_path(
    drafts: &[i64],
    parents: &[i32],
    mut below: impl FnMut(u64) -> u64,
) -> Vec<usize> {
    let mut path = vec![];
    let mut u = -1i32;
    loop {
        let children: Vec<usize> = (0..parents.len()).filter(|&k| parents[k] == u).collect();
        if children.is_empty() || below(3) == 0 {
            return path;
        }
        let tok = drafts[children[below(children.len() as u64) as usize]];
        let c = *children.iter().find(|&&k| drafts[k] == tok).unwrap();
        path.push(c);
        u = c as i32;
    }
}

/// The copy list of one request's accepted path (root at `root`, the first
/// `num_new` emitted tokens appended), as (src, dst) slot positions.
pub fn expected_copies(root: usize, path: &[usize], num_new: usize) -> Vec<(usize, usize)> {
    path.iter()
        .take(num_new)
        .enumerate()
        .map(|(j, &node)| (root + 1 + node, root + 1 + j))
        .filter(|(src, dst)| src != dst)
        .collect()
}
