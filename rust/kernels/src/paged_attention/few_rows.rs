//! The AVX-512 path of the paged-attention kernel for items of few query rows (a decode's GQA
//! group, short verification runs: fewer than half a vector of rows) with head_dim 32, 64 or
//! 128 and no tree mask. The general per-row path (`attend_item`) spent about 170 cycles per
//! key and kv head on a bf16 batch-16 decode (a horizontal sum per score, the accumulators
//! loaded and stored once per key): here a chunk's K and V rows are converted to f32 once, the
//! scores of 16 keys are summed into one vector by a transpose-reduction, and each row's
//! accumulator stays in registers across the chunk. Same rows, masks, window, soft-cap and
//! online softmax as `attend_item`; f32 arithmetic.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::{
    chunk_offsets, exp_shifted, options, window_starts, CapOutlined, Ctx, Item, OutPtr, KEY_CHUNK,
};
use crate::elem::Elem;
use crate::simd::Avx512;

/// Items of at most SHORT_ROWS rows take the path; in batch-invariant mode
/// (`BatchLayout::set_batch_invariant`) items of up to MAX_ROWS rows too: every item the AVX-512
/// tiling makes (tiles of 64 rows) when the group is at most 64 wide, so a query row's attention
/// is computed by the same operations in the same order whether it is a decode, part of a
/// verification run or part of a prefill chunk (the rows of an item do not interact). Its
/// buffers are sized by the const parameter R of `attend_few_rows`: SHORT_ROWS or MAX_ROWS.
pub(super) const MAX_ROWS: usize = 64;
/// The buffer size of decodes and short runs.
pub(super) const SHORT_ROWS: usize = 8;
const MAX_DIM: usize = 128;

/// Whether this path takes the item: Some(vectors per head row) or None.
pub(super) fn vectors_per_row<E>(ctx: &Ctx<'_, E>, it: &Item) -> Option<usize> {
    let rows = (it.q1 - it.q0) * ctx.group;
    if rows > MAX_ROWS || rows == 0 {
        return None;
    }
    if let Some(tree) = ctx.layout.tree.as_ref() {
        if tree.has_tree[it.seq] {
            return None;
        }
    }
    match ctx.geo.head_dim {
        32 => Some(2),
        64 => Some(4),
        128 => Some(8),
        _ => None,
    }
}

/// lane j of the result = the sum of the 16 lanes of v[j].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn transpose_sum(v: &[__m512; 16]) -> __m512 {
    // pairs: per 128-bit lane (a0+a2, b0+b2, a1+a3, b1+b3)
    let mut w = [_mm512_setzero_ps(); 8];
    for j in 0..8 {
        let (a, b) = (v[2 * j], v[2 * j + 1]);
        w[j] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    }
    // quads: per 128-bit lane the lane's sums of four consecutive inputs
    let mut u = [_mm512_setzero_ps(); 4];
    for j in 0..4 {
        let (a, b) = (w[2 * j], w[2 * j + 1]);
        u[j] = _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(a, b),
            _mm512_shuffle_ps::<0xEE>(a, b),
        );
    }
    // across the four 128-bit lanes
    let a = _mm512_add_ps(
        _mm512_shuffle_f32x4::<0x44>(u[0], u[1]),
        _mm512_shuffle_f32x4::<0xEE>(u[0], u[1]),
    );
    let b = _mm512_add_ps(
        _mm512_shuffle_f32x4::<0x44>(u[2], u[3]),
        _mm512_shuffle_f32x4::<0xEE>(u[2], u[3]),
    );
    _mm512_add_ps(
        _mm512_shuffle_f32x4::<0x88>(a, b),
        _mm512_shuffle_f32x4::<0xDD>(a, b),
    )
}

thread_local! {
    static CHUNK_BUFFER: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// This thread's scratch of at least `len` f32s (zeroed once when it grows, not per item).
/// Valid until the thread's next call; an item runs start to end on one thread.
fn chunk_buffer(len: usize) -> *mut f32 {
    CHUNK_BUFFER.with(|b| {
        let mut v = b.borrow_mut();
        if v.len() < len {
            v.resize(len, 0.0);
        }
        v.as_mut_ptr()
    })
}

/// The largest of at most 32 scores (NaN-free: finite scores and -inf).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn row_max(x: &[f32]) -> f32 {
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut m = ninf;
    for c0 in (0..x.len()).step_by(16) {
        let rest = (x.len() - c0).min(16);
        let mask = ((1u32 << rest) - 1) as __mmask16;
        m = _mm512_max_ps(m, _mm512_mask_loadu_ps(ninf, mask, x.as_ptr().add(c0)));
    }
    _mm512_reduce_max_ps(m)
}

/// One item (see the module doc); NV = head_dim / 16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn attend_few_rows<E: Elem, const NV: usize, const R: usize, const OPTS: bool>(
    ctx: &Ctx<'_, E>,
    it: &Item,
    out: OutPtr<E>,
) {
    let (window, softcap) = options::<E, OPTS>(ctx);
    let d = NV * 16;
    let (g, hkv, bs) = (ctx.group, ctx.geo.num_kv_heads, ctx.geo.block_size);
    let lay = ctx.layout;
    let start = lay.query_start_loc[it.seq] as usize;
    let n = lay.query_start_loc[it.seq + 1] as usize - start;
    let context_start = lay.seq_lens[it.seq] as usize - n;
    let table = &lay.block_table[it.seq * lay.table_width..(it.seq + 1) * lay.table_width];
    let rows = (it.q1 - it.q0) * g;
    let mut scratch = [0.0f32; MAX_DIM];
    debug_assert!(rows <= R);
    let mut q = [[_mm512_setzero_ps(); NV]; R]; // scaled queries
    let mut limit = [0usize; R]; // last key each row sees
    let scale = _mm512_set1_ps(ctx.scale);
    for i in 0..it.q1 - it.q0 {
        for j in 0..g {
            let r = i * g + j;
            let src = E::row(
                ctx.q.row(start + it.q0 + i, it.kv_head * g + j),
                &mut scratch[..d],
            );
            for (v, reg) in q[r].iter_mut().enumerate() {
                *reg = _mm512_mul_ps(scale, _mm512_loadu_ps(src.as_ptr().add(16 * v)));
            }
            limit[r] = context_start + it.q0 + i;
        }
    }
    let first_limit = context_start + it.q0;
    let num_keys = context_start + it.q1;
    let mut lo = [0usize; R]; // sliding window: the first key each row sees
    let (first_key, max_lo) = match window {
        None => (0, 0),
        Some(w) => {
            let (min, max) = window_starts(w, g, first_limit, it.q1 - it.q0, None, &mut lo);
            (min / KEY_CHUNK * KEY_CHUNK, max) // aligned: a row's chunks do not depend on its item
        }
    };
    let mut acc = [[_mm512_setzero_ps(); NV]; R];
    let mut run_max = [f32::NEG_INFINITY; R];
    let mut run_sum = [0.0f32; R];
    let mut p = [[0.0f32; KEY_CHUNK]; R]; // scores, then probabilities
                                          // a chunk's K and V rows as f32 (non-f32 caches): [2, KEY_CHUNK, d], this thread's buffer
    let buf = std::slice::from_raw_parts_mut(chunk_buffer(2 * KEY_CHUNK * d), 2 * KEY_CHUNK * d);
    let (kbuf, vbuf) = buf.split_at_mut(KEY_CHUNK * d);
    let mut krows = [std::ptr::null::<f32>(); KEY_CHUNK];
    let mut vrows = [std::ptr::null::<f32>(); KEY_CHUNK];
    let mut offsets = [0usize; KEY_CHUNK];
    let mut next = [0usize; KEY_CHUNK];
    let line_elems = (64 / std::mem::size_of::<E>()).max(1); // elements per cache line
    chunk_offsets(
        &mut next[..KEY_CHUNK.min(num_keys - first_key)],
        table,
        first_key,
        bs,
        hkv,
        it.kv_head,
        d,
    );
    for k0 in (first_key..num_keys).step_by(KEY_CHUNK) {
        let kn = KEY_CHUNK.min(num_keys - k0);
        offsets[..kn].copy_from_slice(&next[..kn]);
        // the next chunk's rows are fetched while this one is computed (blocks are scattered
        // over the pool, which the hardware prefetcher does not follow)
        let k1 = k0 + KEY_CHUNK;
        if k1 < num_keys {
            let kn1 = KEY_CHUNK.min(num_keys - k1);
            chunk_offsets(&mut next[..kn1], table, k1, bs, hkv, it.kv_head, d);
            for &off in &next[..kn1] {
                for e in (0..d).step_by(line_elems) {
                    _mm_prefetch::<_MM_HINT_T1>(ctx.k_cache.as_ptr().add(off + e) as *const i8);
                    _mm_prefetch::<_MM_HINT_T1>(ctx.v_cache.as_ptr().add(off + e) as *const i8);
                }
            }
        }
        for c in 0..kn {
            let off = offsets[c];
            let slot = c * d..(c + 1) * d;
            krows[c] = E::row(&ctx.k_cache[off..off + d], &mut kbuf[slot.clone()]).as_ptr();
            vrows[c] = E::row(&ctx.v_cache[off..off + d], &mut vbuf[slot]).as_ptr();
        }
        // scores, 16 keys at a time per row; two rows per pass share each K load (each row's
        // operations and their order are those of a row alone)
        let mut r = 0;
        while r < rows {
            let pair = r + 1 < rows;
            let (q0, q1) = (&q[r], &q[if pair { r + 1 } else { r }]);
            for c0 in (0..kn).step_by(16) {
                let m = 16.min(kn - c0);
                let mut t0 = [_mm512_setzero_ps(); 16];
                let mut t1 = [_mm512_setzero_ps(); 16];
                for c in 0..m {
                    let kp = krows[c0 + c];
                    let k0 = _mm512_loadu_ps(kp);
                    let mut s0 = _mm512_mul_ps(q0[0], k0);
                    let mut s1 = _mm512_mul_ps(q1[0], k0);
                    for v in 1..NV {
                        let kv = _mm512_loadu_ps(kp.add(16 * v));
                        s0 = _mm512_fmadd_ps(q0[v], kv, s0);
                        s1 = _mm512_fmadd_ps(q1[v], kv, s1);
                    }
                    t0[c] = s0;
                    t1[c] = s1;
                }
                _mm512_storeu_ps(p[r].as_mut_ptr().add(c0), transpose_sum(&t0));
                if pair {
                    _mm512_storeu_ps(p[r + 1].as_mut_ptr().add(c0), transpose_sum(&t1));
                }
            }
            r += 2;
        }
        if let Some(cap) = softcap {
            // the whole chunk width, vector by vector (lanes past kn are masked below)
            for pr in p.iter_mut().take(rows) {
                Avx512::soft_cap_outlined::<false>(&mut pr[..], cap);
            }
        }
        if k0 + kn - 1 > first_limit {
            for (r, pr) in p.iter_mut().enumerate().take(rows) {
                for (c, x) in pr.iter_mut().enumerate().take(kn) {
                    if k0 + c > limit[r] {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
        }
        if k0 < max_lo {
            for (r, pr) in p.iter_mut().enumerate().take(rows) {
                for (c, x) in pr.iter_mut().enumerate().take(kn) {
                    if k0 + c < lo[r] {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
        }
        // online softmax and P V per row, the row's accumulator in registers. The softmax runs
        // over the whole chunk width, keys past kn at -inf (exp: 0), so a row's arithmetic does
        // not depend on where its item's keys end (vector exp for every key, one summation order)
        let mut active = [0usize; R]; // rows with a visible key in this chunk
        let mut num_active = 0;
        for r in 0..rows {
            p[r][kn..].fill(f32::NEG_INFINITY);
            let pr = &mut p[r][..];
            let chunk_max = row_max(pr);
            if chunk_max == f32::NEG_INFINITY {
                continue; // every key of the chunk is in this row's future
            }
            let new_max = run_max[r].max(chunk_max);
            if new_max > run_max[r] && run_sum[r] > 0.0 {
                let correction = (run_max[r] - new_max).exp();
                run_sum[r] *= correction;
                let cv = _mm512_set1_ps(correction);
                for reg in acc[r].iter_mut() {
                    *reg = _mm512_mul_ps(*reg, cv);
                }
            }
            run_max[r] = new_max;
            run_sum[r] += exp_shifted::<Avx512>(pr, new_max); // masked: exp(-inf) = 0
            active[num_active] = r;
            num_active += 1;
        }
        // P V, two rows per pass sharing each V load, each accumulator in registers
        let mut i = 0;
        while i < num_active {
            let r0 = active[i];
            let r1 = if i + 1 < num_active {
                active[i + 1]
            } else {
                r0
            };
            let (mut a0, mut a1) = (acc[r0], acc[r1]);
            for c in 0..kn {
                let vp = vrows[c];
                let (w0, w1) = (_mm512_set1_ps(p[r0][c]), _mm512_set1_ps(p[r1][c]));
                for v in 0..NV {
                    let vv = _mm512_loadu_ps(vp.add(16 * v));
                    a0[v] = _mm512_fmadd_ps(w0, vv, a0[v]);
                    a1[v] = _mm512_fmadd_ps(w1, vv, a1[v]);
                }
            }
            acc[r0] = a0;
            if r1 != r0 {
                acc[r1] = a1;
            }
            i += 2;
        }
    }
    let h = ctx.geo.num_heads;
    for i in 0..it.q1 - it.q0 {
        for j in 0..g {
            let r = i * g + j;
            let inv = _mm512_set1_ps(1.0 / run_sum[r]); // > 0: every row sees its own position
            for (v, reg) in acc[r].iter().enumerate() {
                _mm512_storeu_ps(scratch.as_mut_ptr().add(16 * v), _mm512_mul_ps(*reg, inv));
            }
            let dst = out
                .0
                .add(((start + it.q0 + i) * h + it.kv_head * g + j) * d);
            for (e, &x) in scratch[..d].iter().enumerate() {
                *dst.add(e) = E::from_f32(x);
            }
        }
    }
}
