//! The kernel against a dense f64 oracle: mixed batches (decodes, verification runs, prefill
//! chunks with and without cached context), block sizes 1..32, GQA 1..8, head dims 8..128 and
//! odd ones, every instruction set this CPU has, 1 and 3 threads, f32 and bf16; token trees;
//! sliding windows and soft-caps (alone, together, with trees, in batch-invariant mode).

use super::*;
use crate::elem::Bf16;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// A random paged batch: (cached c, query n) per run, blocks scattered, q/k/v strided views of
/// one fused qkv buffer. Returns the layout, the geometry, the cache with the context written,
/// the fused qkv buffer and its row stride, and the full per-run K/V [len, hkv, d].
struct Batch {
    layout: BatchLayout,
    geo: HeadGeometry,
    cache: Vec<f32>,
    qkv: Vec<f32>,
    qkv_stride: usize,
    full_k: Vec<Vec<f32>>,
    full_v: Vec<Vec<f32>>,
    runs: Vec<(usize, usize)>,
}

fn make_batch(
    runs: &[(usize, usize)],
    bs: usize,
    h: usize,
    hkv: usize,
    d: usize,
    seed: u64,
) -> Batch {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let nb: usize = runs
        .iter()
        .map(|&(c, n)| (c + n).div_ceil(bs))
        .sum::<usize>()
        + 3;
    let mut free: Vec<usize> = (0..nb).collect();
    for i in (1..free.len()).rev() {
        let j = ((rng.next() + 1.0) * 0.5 * (i + 1) as f32) as usize % (i + 1);
        free.swap(i, j);
    }
    let half = nb * bs * hkv * d;
    let mut cache = vec![0.0f32; 2 * half];
    let w = runs
        .iter()
        .map(|&(c, n)| (c + n).div_ceil(bs))
        .max()
        .unwrap_or(0)
        + 2;
    let (mut table, mut slots, mut qsl, mut lens) =
        (vec![0i32; runs.len() * w], vec![], vec![0i32], vec![]);
    let (mut full_k, mut full_v) = (vec![], vec![]);
    let t: usize = runs.iter().map(|r| r.1).sum();
    let qkv_stride = (h + 2 * hkv) * d;
    let mut qkv: Vec<f32> = (0..t * qkv_stride).map(|_| rng.next()).collect();
    let mut tok = 0;
    for (s, &(c, n)) in runs.iter().enumerate() {
        let len = c + n;
        let blocks: Vec<usize> = (0..len.div_ceil(bs)).map(|_| free.pop().unwrap()).collect();
        for (i, &b) in blocks.iter().enumerate() {
            table[s * w + i] = b as i32;
        }
        let kk: Vec<f32> = (0..len * hkv * d).map(|_| rng.next()).collect();
        let vv: Vec<f32> = (0..len * hkv * d).map(|_| rng.next()).collect();
        for p in 0..len {
            let slot = blocks[p / bs] * bs + p % bs;
            let row = p * hkv * d..(p + 1) * hkv * d;
            if p < c {
                cache[slot * hkv * d..(slot + 1) * hkv * d].copy_from_slice(&kk[row.clone()]);
                cache[half + slot * hkv * d..half + (slot + 1) * hkv * d].copy_from_slice(&vv[row]);
            } else {
                slots.push(slot as i64);
                let base = tok * qkv_stride + h * d;
                qkv[base..base + hkv * d].copy_from_slice(&kk[row.clone()]);
                qkv[base + hkv * d..base + 2 * hkv * d].copy_from_slice(&vv[row]);
                tok += 1;
            }
        }
        full_k.push(kk);
        full_v.push(vv);
        qsl.push(qsl.last().unwrap() + n as i32);
        lens.push(len as i32);
    }
    let layout = BatchLayout::new(slots, qsl, lens, table, w, bs).unwrap();
    let geo = HeadGeometry {
        num_heads: h,
        num_kv_heads: hkv,
        head_dim: d,
        block_size: bs,
        num_blocks: nb,
    };
    Batch {
        layout,
        geo,
        cache,
        qkv,
        qkv_stride,
        full_k,
        full_v,
        runs: runs.to_vec(),
    }
}

fn view<'a, E>(data: &'a [E], b: &Batch, offset_heads: usize, heads: usize) -> StridedHeads<'a, E> {
    let d = b.geo.head_dim;
    StridedHeads {
        data: &data[offset_heads * d..],
        num_tokens: b.layout.num_tokens(),
        num_heads: heads,
        head_dim: d,
        token_stride: b.qkv_stride,
        head_stride: d,
    }
}

/// Dense causal attention in f64, [T, h, d].
fn oracle(b: &Batch, qkv: &[f32], scale: f64) -> Vec<f64> {
    oracle_masked(b, qkv, scale, &|s, i, p| p <= b.runs[s].0 + i)
}

/// Dense attention in f64, [T, h, d]: query token i of run s sees key position p iff
/// `visible(s, i, p)` (p over the run's whole context).
fn oracle_masked(
    b: &Batch,
    qkv: &[f32],
    scale: f64,
    visible: &dyn Fn(usize, usize, usize) -> bool,
) -> Vec<f64> {
    oracle_capped(b, qkv, scale, visible, None)
}

/// [`oracle_masked`] with an optional soft-cap c: each visible score s becomes c tanh(s / c).
fn oracle_capped(
    b: &Batch,
    qkv: &[f32],
    scale: f64,
    visible: &dyn Fn(usize, usize, usize) -> bool,
    softcap: Option<f64>,
) -> Vec<f64> {
    let (h, hkv, d) = (b.geo.num_heads, b.geo.num_kv_heads, b.geo.head_dim);
    let g = h / hkv;
    let mut out = vec![];
    let mut tok = 0;
    for (s, &(c, n)) in b.runs.iter().enumerate() {
        for i in 0..n {
            for head in 0..h {
                let kvh = head / g;
                let q = &qkv[tok * b.qkv_stride + head * d..][..d];
                let keys = c + n;
                let scores: Vec<f64> = (0..keys)
                    .map(|p| {
                        if !visible(s, i, p) {
                            return f64::NEG_INFINITY;
                        }
                        let k = &b.full_k[s][(p * hkv + kvh) * d..][..d];
                        let x = q
                            .iter()
                            .zip(k)
                            .map(|(x, y)| *x as f64 * *y as f64)
                            .sum::<f64>()
                            * scale;
                        softcap.map_or(x, |c| c * (x / c).tanh())
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for dd in 0..d {
                    out.push(
                        (0..keys)
                            .map(|p| e[p] * b.full_v[s][(p * hkv + kvh) * d + dd] as f64)
                            .sum::<f64>()
                            / z,
                    );
                }
            }
            tok += 1;
        }
    }
    out
}

const MIXED: &[(usize, usize)] = &[(7, 1), (12, 5), (3, 40), (0, 33), (0, 1), (20, 17)];
const DECODES: &[(usize, usize)] = &[(7, 1), (30, 1), (0, 1), (12, 1), (100, 1)];
const VERIFY: &[(usize, usize)] = &[(7, 4), (20, 4), (3, 4)];
const LONG: &[(usize, usize)] = &[(70, 90), (300, 1), (5, 200)];

fn check_f32(
    runs: &[(usize, usize)],
    bs: usize,
    h: usize,
    hkv: usize,
    d: usize,
    isa: Isa,
    threads: usize,
) {
    check_opts(
        runs,
        bs,
        h,
        hkv,
        d,
        isa,
        threads,
        AttentionOptions::default(),
    );
}

/// Whether a causal query at position `pos` sees key `p` under sliding window `w`.
fn in_window(pos: usize, p: usize, window: Option<usize>) -> bool {
    p <= pos && pos - p < window.unwrap_or(usize::MAX)
}

#[allow(clippy::too_many_arguments)]
fn check_opts(
    runs: &[(usize, usize)],
    bs: usize,
    h: usize,
    hkv: usize,
    d: usize,
    isa: Isa,
    threads: usize,
    opts: AttentionOptions,
) {
    let mut b = make_batch(
        runs,
        bs,
        h,
        hkv,
        d,
        (bs * 131 + h * 17 + hkv * 7 + d) as u64,
    );
    let scale = 1.0 / (d as f32).sqrt();
    let qkv = b.qkv.clone();
    store_kv(
        &b.layout,
        &b.geo,
        view(&qkv, &b, h, hkv),
        view(&qkv, &b, h + hkv, hkv),
        &mut b.cache,
    )
    .unwrap();
    let mut out = vec![0.0f32; b.layout.num_tokens() * h * d];
    paged_attention_with(
        isa,
        threads,
        &b.layout,
        &b.geo,
        view(&qkv, &b, 0, h),
        &b.cache,
        &mut out,
        scale,
        opts,
    )
    .unwrap();
    let visible = |s: usize, i: usize, p: usize| in_window(b.runs[s].0 + i, p, opts.window);
    let want = oracle_capped(
        &b,
        &qkv,
        scale as f64,
        &visible,
        opts.softcap.map(f64::from),
    );
    for (i, (&o, &w)) in out.iter().zip(&want).enumerate() {
        assert!(
            (o as f64 - w).abs() <= 2e-5 + 2e-5 * w.abs(),
            "{isa:?} threads={threads} runs={runs:?} bs={bs} h={h} hkv={hkv} d={d} {opts:?}: element {i}: {o} vs {w}"
        );
    }
}

#[test]
fn f32_matches_dense_oracle_over_the_matrix() {
    for isa in Isa::supported() {
        for runs in [MIXED, DECODES, VERIFY] {
            for bs in [1, 4, 16, 32] {
                for (h, hkv) in [(4, 4), (4, 2), (8, 1), (8, 8), (6, 3)] {
                    check_f32(runs, bs, h, hkv, 8, isa, 1);
                }
            }
        }
    }
}

#[test]
fn head_dims_with_and_without_vector_tails() {
    for isa in Isa::supported() {
        for d in [8, 20, 32, 64, 80, 128] {
            check_f32(MIXED, 16, 4, 2, d, isa, 1);
        }
    }
}

#[test]
fn long_runs_split_into_tiles_and_threads_agree() {
    for isa in Isa::supported() {
        for threads in [1, 3] {
            check_f32(LONG, 16, 8, 1, 64, isa, threads);
            check_f32(LONG, 8, 4, 4, 32, isa, threads);
        }
    }
}

#[test]
fn bf16_matches_dense_oracle_within_bf16_rounding() {
    check_bf16(AttentionOptions::default());
}

fn check_bf16(opts: AttentionOptions) {
    let (h, hkv, d, bs) = (8, 2, 64, 16);
    let b = make_batch(MIXED, bs, h, hkv, d, 5);
    let to16 = |xs: &[f32]| xs.iter().map(|&x| Bf16::from_f32(x)).collect::<Vec<_>>();
    let qkv16 = to16(&b.qkv);
    let mut cache16 = to16(&b.cache);
    // the oracle sees exactly the bf16-rounded inputs
    let mut b32 = make_batch(MIXED, bs, h, hkv, d, 5);
    let round = |xs: &mut Vec<f32>| xs.iter_mut().for_each(|x| *x = Bf16::from_f32(*x).to_f32());
    round(&mut b32.qkv);
    b32.full_k.iter_mut().for_each(round);
    b32.full_v.iter_mut().for_each(round);
    let scale = 1.0 / (d as f32).sqrt();
    let visible = |s: usize, i: usize, p: usize| in_window(MIXED[s].0 + i, p, opts.window);
    let want = oracle_capped(
        &b32,
        &b32.qkv,
        scale as f64,
        &visible,
        opts.softcap.map(f64::from),
    );
    store_kv(
        &b.layout,
        &b.geo,
        view(&qkv16, &b, h, hkv),
        view(&qkv16, &b, h + hkv, hkv),
        &mut cache16,
    )
    .unwrap();
    for isa in Isa::supported() {
        let mut out = vec![Bf16::default(); b.layout.num_tokens() * h * d];
        paged_attention_with(
            isa,
            2,
            &b.layout,
            &b.geo,
            view(&qkv16, &b, 0, h),
            &cache16,
            &mut out,
            scale,
            opts,
        )
        .unwrap();
        for (i, (o, &w)) in out.iter().zip(&want).enumerate() {
            let o = o.to_f32() as f64;
            assert!(
                (o - w).abs() <= 1e-5 + 8e-3 * w.abs(),
                "{isa:?} {opts:?} element {i}: {o} vs {w}"
            );
        }
    }
}

#[test]
fn store_kv_writes_exactly_the_slots() {
    let (h, hkv, d, bs) = (4, 2, 8, 4);
    let mut b = make_batch(MIXED, bs, h, hkv, d, 9);
    let before = b.cache.clone();
    let qkv = b.qkv.clone();
    store_kv(
        &b.layout,
        &b.geo,
        view(&qkv, &b, h, hkv),
        view(&qkv, &b, h + hkv, hkv),
        &mut b.cache,
    )
    .unwrap();
    let half = b.geo.cache_half_len();
    let row = hkv * d;
    let written: std::collections::HashSet<usize> =
        b.layout.slot_mapping.iter().map(|&s| s as usize).collect();
    for slot in 0..half / row {
        for kv in 0..2 {
            let range = kv * half + slot * row..kv * half + (slot + 1) * row;
            if !written.contains(&slot) {
                assert_eq!(b.cache[range.clone()], before[range]);
            }
        }
    }
    for (tok, &slot) in b.layout.slot_mapping.iter().enumerate() {
        let slot = slot as usize;
        assert_eq!(
            b.cache[slot * row..(slot + 1) * row],
            qkv[tok * b.qkv_stride + h * d..][..row]
        );
        assert_eq!(
            b.cache[half + slot * row..half + (slot + 1) * row],
            qkv[tok * b.qkv_stride + (h + hkv) * d..][..row]
        );
    }
}

#[test]
fn bad_layouts_are_refused_naming_the_field() {
    let e = BatchLayout::new(vec![0], vec![0, 1], vec![1], vec![0], 1, 0).unwrap_err();
    assert_eq!(e.field, "block_size");
    let e = BatchLayout::new(vec![0, 1], vec![0, 1], vec![1], vec![0], 1, 4).unwrap_err();
    assert_eq!(e.field, "query_start_loc");
    let e = BatchLayout::new(vec![0, 1], vec![0, 2], vec![1], vec![0], 1, 4).unwrap_err();
    assert_eq!(e.field, "seq_lens");
    let e = BatchLayout::new(vec![0], vec![0, 1], vec![9], vec![0, 1], 2, 4).unwrap_err();
    assert_eq!(e.field, "block_table");
    let e = BatchLayout::new(vec![-1], vec![0, 1], vec![1], vec![0], 1, 4).unwrap_err();
    assert_eq!(e.field, "slot_mapping");
    // a block id past the cache is caught when the cache is known
    let layout = BatchLayout::new(vec![0], vec![0, 1], vec![1], vec![5], 1, 4).unwrap();
    let geo = HeadGeometry {
        num_heads: 2,
        num_kv_heads: 1,
        head_dim: 8,
        block_size: 4,
        num_blocks: 2,
    };
    let cache = vec![0.0f32; 2 * geo.cache_half_len()];
    let q = vec![0.0f32; 16];
    let mut out = vec![0.0f32; 16];
    let qv = StridedHeads {
        data: &q,
        num_tokens: 1,
        num_heads: 2,
        head_dim: 8,
        token_stride: 16,
        head_stride: 8,
    };
    let e = paged_attention(Isa::Scalar, 1, &layout, &geo, qv, &cache, &mut out, 1.0).unwrap_err();
    assert_eq!(e.field, "block_table");
    // GQA needs num_heads to be a multiple of num_kv_heads
    let layout = BatchLayout::new(vec![0], vec![0, 1], vec![1], vec![0], 1, 4).unwrap();
    let geo3 = HeadGeometry {
        num_kv_heads: 3,
        ..geo
    };
    let e = paged_attention(Isa::Scalar, 1, &layout, &geo3, qv, &cache, &mut out, 1.0).unwrap_err();
    assert_eq!(e.field, "num_heads");
    // a q view whose strides run past its buffer
    let short = StridedHeads {
        data: &q[..10],
        ..qv
    };
    let e =
        paged_attention(Isa::Scalar, 1, &layout, &geo, short, &cache, &mut out, 1.0).unwrap_err();
    assert_eq!(e.field, "q");
}

#[test]
fn skipped_runs_are_left_untouched_and_the_rest_still_match() {
    let (h, hkv, d, bs) = (4, 2, 16, 4);
    let mut b = make_batch(MIXED, bs, h, hkv, d, 11);
    let skip: Vec<bool> = MIXED.iter().map(|&(_, n)| n > 16).collect();
    b.layout.skip_attention(skip.clone()).unwrap();
    assert_eq!(
        b.layout
            .clone()
            .skip_attention(vec![true])
            .unwrap_err()
            .field,
        "skip"
    );
    let qkv = b.qkv.clone();
    store_kv(
        &b.layout,
        &b.geo,
        view(&qkv, &b, h, hkv),
        view(&qkv, &b, h + hkv, hkv),
        &mut b.cache,
    )
    .unwrap();
    let mut out = vec![7.0f32; b.layout.num_tokens() * h * d];
    let scale = 0.25;
    paged_attention(
        Isa::detect(),
        2,
        &b.layout,
        &b.geo,
        view(&qkv, &b, 0, h),
        &b.cache,
        &mut out,
        scale,
    )
    .unwrap();
    let want = oracle(&b, &qkv, scale as f64);
    let mut tok = 0;
    for (s, &(_, n)) in MIXED.iter().enumerate() {
        for i in tok * h * d..(tok + n) * h * d {
            if skip[s] {
                assert_eq!(out[i], 7.0);
            } else {
                assert!((out[i] as f64 - want[i]).abs() < 2e-5 * (1.0 + want[i].abs()));
            }
        }
        tok += n;
    }
}

/// A run's tree: its root sits at position `root` of the context; `nodes[i]` = the key positions
/// (relative to the root) query token i of the run may see there, as an explicit list.
struct TreeRun {
    root: usize,
    visible: Vec<Vec<usize>>,
}

/// Random parent arrays (parent < own index, -1 = child of the root) -> each node's explicit
/// ancestor-or-self list, root (0) included; node i sits at relative position i + 1.
fn random_tree(rng: &mut Rng, nodes: usize) -> Vec<Vec<usize>> {
    let mut parents: Vec<i64> = vec![];
    for i in 0..nodes {
        let u = ((rng.next() + 1.0) * 0.5 * (i + 1) as f32) as i64;
        parents.push(u.min(i as i64) - 1);
    }
    let mut lists = vec![vec![0usize]];
    for i in 0..nodes {
        let mut seen = vec![i + 1];
        let mut p = parents[i];
        while p >= 0 {
            seen.push(p as usize + 1);
            p = parents[p as usize];
        }
        seen.push(0);
        lists.push(seen);
    }
    lists
}

fn mask_bits(list: &[usize]) -> i64 {
    list.iter().fold(0u64, |m, &j| m | (1u64 << j)) as i64
}

/// Mixed batches with token trees next to causal runs: MQA tree runs (root + nodes as one run)
/// and batch-expanded nodes (single-token runs whose context ends at the node), against the
/// oracle with explicit visibility lists.
#[allow(clippy::too_many_arguments)]
fn check_trees(
    cached: &[usize],
    bs: usize,
    h: usize,
    hkv: usize,
    d: usize,
    isa: Isa,
    threads: usize,
    seed: u64,
) {
    check_trees_with(
        cached,
        (bs, h, hkv, d),
        isa,
        threads,
        seed,
        AttentionOptions::default(),
    );
}

/// [`check_trees`] with a layer's options: under a window W a tree token at logical position
/// p = root + depth sees prefix keys j with p - j < W and its ancestors whatever W.
fn check_trees_with(
    cached: &[usize],
    (bs, h, hkv, d): (usize, usize, usize, usize),
    isa: Isa,
    threads: usize,
    seed: u64,
    opts: AttentionOptions,
) {
    let mut rng = Rng(seed | 1);
    // runs: a prefill chunk, a decode, a chain verification, then trees (the tree sizes
    // include 63 nodes: bit 63, the sign bit of the int64 mask)
    let mut runs: Vec<(usize, usize)> = vec![(cached[0], 37), (cached[1], 1), (cached[2], 5)];
    let mut trees: Vec<Option<TreeRun>> = vec![None, None, None];
    for (k, &nodes) in [63usize, 9, 1, 30].iter().enumerate() {
        let c = cached[(3 + k) % cached.len()];
        let lists = random_tree(&mut rng, nodes);
        runs.push((c, nodes + 1)); // MQA: root + every node in one run
        trees.push(Some(TreeRun {
            root: c,
            visible: lists.clone(),
        }));
        // the same tree queried in reverse: a row's mask may name slots after its own position
        // (a proposer's query need not be the context's last tokens)
        runs.push((c, nodes + 1));
        trees.push(Some(TreeRun {
            root: c,
            visible: lists.iter().rev().cloned().collect(),
        }));
        for node in [nodes, nodes / 2] {
            // batch expansion: node `node` alone, its context ending at its own position
            runs.push((c + node, 1));
            trees.push(Some(TreeRun {
                root: c,
                visible: vec![lists[node].clone()],
            }));
        }
    }
    let mut b = make_batch(&runs, bs, h, hkv, d, seed);
    let mut mask = vec![];
    let mut start = vec![];
    for (s, &(c, n)) in runs.iter().enumerate() {
        match &trees[s] {
            None => {
                mask.extend(std::iter::repeat_n(0i64, n));
                start.push(c as i32);
            }
            Some(t) => {
                mask.extend(t.visible.iter().map(|l| mask_bits(l)));
                start.push(t.root as i32);
            }
        }
    }
    b.layout.set_tree_masks(mask, start).unwrap();
    let scale = 1.0 / (d as f32).sqrt();
    let qkv = b.qkv.clone();
    store_kv(
        &b.layout,
        &b.geo,
        view(&qkv, &b, h, hkv),
        view(&qkv, &b, h + hkv, hkv),
        &mut b.cache,
    )
    .unwrap();
    let mut out = vec![0.0f32; b.layout.num_tokens() * h * d];
    paged_attention_with(
        isa,
        threads,
        &b.layout,
        &b.geo,
        view(&qkv, &b, 0, h),
        &b.cache,
        &mut out,
        scale,
        opts,
    )
    .unwrap();
    let w = opts.window.unwrap_or(usize::MAX);
    let visible = |s: usize, i: usize, p: usize| match &trees[s] {
        None => in_window(runs[s].0 + i, p, opts.window),
        Some(t) => {
            let logical = t.root + t.visible[i].len() - 1; // root + depth
            if p < t.root {
                logical - p < w
            } else {
                t.visible[i].contains(&(p - t.root))
            }
        }
    };
    let want = oracle_capped(
        &b,
        &qkv,
        scale as f64,
        &visible,
        opts.softcap.map(f64::from),
    );
    for (i, (&o, &w)) in out.iter().zip(&want).enumerate() {
        assert!(
            (o as f64 - w).abs() <= 2e-5 + 2e-5 * w.abs(),
            "{isa:?} threads={threads} cached={cached:?} bs={bs} h={h} hkv={hkv} d={d} {opts:?}: element {i}: {o} vs {w}"
        );
    }
}

#[test]
fn tree_masks_match_dense_oracle_in_mixed_batches() {
    for isa in Isa::supported() {
        for (bs, cached) in [(1, [0, 5, 3, 0]), (4, [7, 0, 12, 2]), (16, [40, 3, 70, 31])] {
            for (h, hkv) in [(4, 4), (8, 2), (8, 1)] {
                for d in [8, 32] {
                    let seed = (bs * 31 + h * 7 + hkv * 3 + d) as u64;
                    check_trees(&cached, bs, h, hkv, d, isa, 1, seed);
                }
            }
        }
        check_trees(&[33, 1, 64, 2], 8, 4, 2, 64, isa, 3, 77);
    }
}

#[test]
fn bad_tree_masks_are_refused_naming_the_field() {
    let mut layout = BatchLayout::new(vec![0, 1], vec![0, 2], vec![2], vec![0], 1, 4).unwrap();
    assert_eq!(
        layout.set_tree_masks(vec![1], vec![0]).unwrap_err().field,
        "tree_mask"
    );
    assert_eq!(
        layout
            .set_tree_masks(vec![1, 3], vec![0, 0])
            .unwrap_err()
            .field,
        "tree_start"
    );
    assert_eq!(
        layout
            .set_tree_masks(vec![1, 3], vec![3])
            .unwrap_err()
            .field,
        "tree_start"
    );
    assert_eq!(
        layout
            .set_tree_masks(vec![1, 2], vec![0])
            .unwrap_err()
            .field,
        "tree_mask" // the second token cannot see key 0: a row without keys
    );
    layout.set_tree_masks(vec![1, 3], vec![0]).unwrap();
    layout.set_tree_masks(vec![0, 0], vec![-5]).unwrap(); // no tree token: tree_start unread
    assert!(layout.tree.is_none());
}

/// Items of fewer than 8 query rows (decodes and runs of 2-3 tokens with GQA groups of 1-3)
/// at head dims 32 / 64 / 128 take the AVX-512 few-rows path where the CPU has it: contexts
/// across key-chunk boundaries (31, 32, 33, 100 keys), block sizes 1 and 16, rows of one item
/// with different causal limits.
#[test]
fn few_row_items_match_dense_oracle() {
    const FEW: &[(usize, usize)] = &[
        (30, 1),
        (31, 1),
        (32, 1),
        (99, 1),
        (30, 2),
        (31, 3),
        (0, 2),
        (64, 3),
    ];
    for isa in Isa::supported() {
        for d in [32, 64, 128] {
            for bs in [1, 16] {
                for (h, hkv) in [(2, 2), (4, 2), (6, 2), (9, 3)] {
                    check_f32(FEW, bs, h, hkv, d, isa, 1);
                }
            }
        }
    }
}

/// One sequence of `len` tokens (q [len, h, d], k/v [len, hkv, d]) attended as a run of the last
/// `n` tokens after `len - n` cached ones (blocks in order); returns the run's output rows.
fn attend_split(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    (len, n): (usize, usize),
    (h, hkv, d, bs): (usize, usize, usize, usize),
    isa: Isa,
) -> Vec<f32> {
    attend_split_with(
        q,
        k,
        v,
        (len, n),
        (h, hkv, d, bs),
        isa,
        AttentionOptions::default(),
    )
}

fn attend_split_with(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    (len, n): (usize, usize),
    (h, hkv, d, bs): (usize, usize, usize, usize),
    isa: Isa,
    opts: AttentionOptions,
) -> Vec<f32> {
    let c = len - n;
    let nb = len.div_ceil(bs) + 1;
    let geo = HeadGeometry {
        num_heads: h,
        num_kv_heads: hkv,
        head_dim: d,
        block_size: bs,
        num_blocks: nb,
    };
    let half = geo.cache_half_len();
    let mut cache = vec![0.0f32; 2 * half];
    let row = hkv * d;
    cache[..c * row].copy_from_slice(&k[..c * row]);
    cache[half..half + c * row].copy_from_slice(&v[..c * row]);
    let stride = (h + 2 * hkv) * d;
    let mut qkv = vec![0.0f32; n * stride];
    for t in 0..n {
        let p = c + t;
        qkv[t * stride..t * stride + h * d].copy_from_slice(&q[p * h * d..(p + 1) * h * d]);
        qkv[t * stride + h * d..t * stride + h * d + row]
            .copy_from_slice(&k[p * row..(p + 1) * row]);
        qkv[t * stride + h * d + row..(t + 1) * stride].copy_from_slice(&v[p * row..(p + 1) * row]);
    }
    let table: Vec<i32> = (0..nb as i32).collect();
    let slots: Vec<i64> = (c..len).map(|p| p as i64).collect();
    let mut layout =
        BatchLayout::new(slots, vec![0, n as i32], vec![len as i32], table, nb, bs).unwrap();
    layout.set_batch_invariant(true);
    let hv = |off: usize, heads: usize| StridedHeads {
        data: &qkv[off * d..],
        num_tokens: n,
        num_heads: heads,
        head_dim: d,
        token_stride: stride,
        head_stride: d,
    };
    store_kv(&layout, &geo, hv(h, hkv), hv(h + hkv, hkv), &mut cache).unwrap();
    let mut out = vec![0.0f32; n * h * d];
    let scale = 1.0 / (d as f32).sqrt();
    paged_attention_with(
        isa,
        1,
        &layout,
        &geo,
        hv(0, h),
        &cache,
        &mut out,
        scale,
        opts,
    )
    .unwrap();
    out
}

/// Batch-invariant mode, every instruction set: a query row's output is the same bits as a
/// decode, inside a verification run or inside a prefill chunk (AVX-512 with head_dim 32 / 64 /
/// 128: the few-rows path for every item; otherwise the per-row path): greedy speculative
/// decoding stays exact even where the next layer rounds its input to a grid (w8a8). Head dim 48
/// takes the per-row path everywhere.
#[test]
fn a_row_is_computed_the_same_as_decode_verification_run_or_prefill_chunk() {
    for (h, hkv, d) in [(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 2, 48)] {
        let (len, bs) = (70, 16);
        let mut rng = Rng(0x1234_5678 + d as u64);
        let q: Vec<f32> = (0..len * h * d).map(|_| rng.next()).collect();
        let k: Vec<f32> = (0..len * hkv * d).map(|_| rng.next()).collect();
        let v: Vec<f32> = (0..len * hkv * d).map(|_| rng.next()).collect();
        for isa in Isa::supported() {
            let geo = (h, hkv, d, bs);
            let prefill = attend_split(&q, &k, &v, (len, len), geo, isa); // one 70-token chunk
            for (upto, n) in [(70, 1), (70, 5), (66, 9), (41, 1), (41, 3), (64, 30)] {
                let run = attend_split(&q, &k, &v, (upto, n), geo, isa);
                let want = &prefill[(upto - n) * h * d..upto * h * d];
                assert!(
                    run == want,
                    "{isa:?} h={h} hkv={hkv} d={d} run ({upto}, {n}) differs in bits"
                );
            }
        }
    }
}

/// Runs whose windows start mid-block, mid-chunk and on chunk boundaries (KEY_CHUNK = 32): long
/// decodes, verification runs, a prefill chunk after cached context (several query tiles, rows
/// of one tile with different window starts), a first chunk.
const WINDOWED: &[(usize, usize)] = &[
    (7, 1),
    (100, 1),
    (64, 1),
    (40, 5),
    (3, 40),
    (0, 33),
    (70, 90),
    (31, 3),
];

fn window(w: usize) -> AttentionOptions {
    AttentionOptions {
        window: Some(w),
        softcap: None,
    }
}

#[test]
fn sliding_windows_match_dense_oracle() {
    for isa in Isa::supported() {
        for w in [1, 4, 31, 33, 64, 1000] {
            for (bs, h, hkv, d) in [(1, 4, 4, 8), (16, 8, 2, 64), (4, 6, 3, 32), (8, 4, 1, 128)] {
                check_opts(WINDOWED, bs, h, hkv, d, isa, 1, window(w));
            }
        }
    }
}

#[test]
fn softcap_alone_and_with_a_window_match_dense_oracle() {
    for isa in Isa::supported() {
        for (w, cap) in [(None, 0.25), (None, 3.0), (Some(20), 1.0), (Some(1), 0.5)] {
            let opts = AttentionOptions {
                window: w,
                softcap: Some(cap),
            };
            for (bs, h, hkv, d) in [(4, 4, 4, 8), (16, 8, 2, 64), (16, 9, 3, 32), (1, 4, 2, 20)] {
                check_opts(WINDOWED, bs, h, hkv, d, isa, 1, opts);
            }
        }
    }
}

#[test]
fn windowed_long_runs_over_threads_and_bf16() {
    let both = AttentionOptions {
        window: Some(50),
        softcap: Some(2.0),
    };
    for isa in Isa::supported() {
        for threads in [1, 3] {
            check_opts(LONG, 16, 8, 1, 64, isa, threads, window(100));
            check_opts(LONG, 8, 4, 4, 32, isa, threads, both);
        }
    }
    check_bf16(window(9));
    check_bf16(both);
}

/// Few-row items (the AVX-512 few-rows path where the CPU has it) with windows and caps.
#[test]
fn few_row_items_with_windows_and_caps_match_dense_oracle() {
    const FEW: &[(usize, usize)] = &[(30, 1), (33, 1), (99, 1), (64, 3), (31, 3), (0, 2)];
    for isa in Isa::supported() {
        for d in [32, 64, 128] {
            for (w, cap) in [
                (Some(3), None),
                (Some(32), None),
                (Some(40), Some(1.5)),
                (None, Some(0.5)),
            ] {
                let opts = AttentionOptions {
                    window: w,
                    softcap: cap,
                };
                check_opts(FEW, 16, 4, 2, d, isa, 1, opts);
                check_opts(FEW, 1, 3, 3, d, isa, 1, opts);
            }
        }
    }
}

#[test]
fn tree_tokens_take_the_window_by_logical_position() {
    for isa in Isa::supported() {
        for (bs, cached) in [(4, [7, 0, 12, 2]), (16, [40, 3, 70, 31])] {
            for (h, hkv, d) in [(4, 4, 8), (8, 2, 32)] {
                for (w, cap) in [
                    (1, None),
                    (5, None),
                    (40, None),
                    (64, Some(2.0)),
                    (90, None),
                ] {
                    let opts = AttentionOptions {
                        window: Some(w),
                        softcap: cap,
                    };
                    let seed = (bs * 31 + h * 7 + hkv * 3 + d + w) as u64;
                    check_trees_with(&cached, (bs, h, hkv, d), isa, 1, seed, opts);
                }
            }
        }
        let opts = AttentionOptions {
            window: Some(20),
            softcap: Some(1.0),
        };
        check_trees_with(&[33, 1, 64, 2], (8, 4, 2, 64), isa, 3, 77, opts);
    }
}

/// A window past every context changes nothing: the same bits as no window, every path.
#[test]
fn a_window_longer_than_every_context_is_the_same_bits_as_none() {
    for isa in Isa::supported() {
        for (bs, h, hkv, d) in [(16, 8, 2, 64), (4, 6, 3, 32), (16, 4, 4, 8)] {
            let mut b = make_batch(WINDOWED, bs, h, hkv, d, 3);
            let qkv = b.qkv.clone();
            store_kv(
                &b.layout,
                &b.geo,
                view(&qkv, &b, h, hkv),
                view(&qkv, &b, h + hkv, hkv),
                &mut b.cache,
            )
            .unwrap();
            let run = |opts| {
                let mut out = vec![0.0f32; b.layout.num_tokens() * h * d];
                let q = view(&qkv, &b, 0, h);
                paged_attention_with(isa, 2, &b.layout, &b.geo, q, &b.cache, &mut out, 0.2, opts)
                    .unwrap();
                out
            };
            assert!(
                run(AttentionOptions::default()) == run(window(160)),
                "{isa:?}"
            );
        }
    }
}

#[test]
fn bad_options_are_refused_naming_the_field() {
    let b = make_batch(&[(3, 1)], 4, 2, 1, 8, 1);
    let mut out = vec![0.0f32; 16];
    let q = view(&b.qkv, &b, 0, 2);
    let bad = [
        (window(0), "window"),
        (
            AttentionOptions {
                window: None,
                softcap: Some(0.0),
            },
            "softcap",
        ),
        (
            AttentionOptions {
                window: Some(4),
                softcap: Some(-1.0),
            },
            "softcap",
        ),
        (
            AttentionOptions {
                window: None,
                softcap: Some(f32::NAN),
            },
            "softcap",
        ),
        (
            AttentionOptions {
                window: None,
                softcap: Some(f32::INFINITY),
            },
            "softcap",
        ),
    ];
    for (opts, field) in bad {
        let e = paged_attention_with(
            Isa::Scalar,
            1,
            &b.layout,
            &b.geo,
            q,
            &b.cache,
            &mut out,
            1.0,
            opts,
        )
        .unwrap_err();
        assert_eq!(e.field, field, "{opts:?}");
    }
}

/// Batch-invariant mode with a window and a soft-cap: a row's bits do not depend on its run
/// (the chunk grid stays aligned however far the item's windows start).
#[test]
fn windowed_capped_rows_are_computed_the_same_in_any_run() {
    for (h, hkv, d) in [(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 2, 48)] {
        let (len, bs) = (70, 16);
        let mut rng = Rng(0x5eed_0000 + d as u64);
        let q: Vec<f32> = (0..len * h * d).map(|_| rng.next()).collect();
        let k: Vec<f32> = (0..len * hkv * d).map(|_| rng.next()).collect();
        let v: Vec<f32> = (0..len * hkv * d).map(|_| rng.next()).collect();
        for opts in [
            window(20),
            window(33),
            AttentionOptions {
                window: Some(40),
                softcap: Some(1.0),
            },
            AttentionOptions {
                window: None,
                softcap: Some(0.5),
            },
        ] {
            for isa in Isa::supported() {
                let geo = (h, hkv, d, bs);
                let prefill = attend_split_with(&q, &k, &v, (len, len), geo, isa, opts);
                for (upto, n) in [(70, 1), (70, 5), (66, 9), (41, 1), (41, 3), (64, 30)] {
                    let run = attend_split_with(&q, &k, &v, (upto, n), geo, isa, opts);
                    let want = &prefill[(upto - n) * h * d..upto * h * d];
                    assert!(
                        run == want,
                        "{isa:?} h={h} hkv={hkv} d={d} {opts:?} run ({upto}, {n}) differs in bits"
                    );
                }
            }
        }
    }
}
