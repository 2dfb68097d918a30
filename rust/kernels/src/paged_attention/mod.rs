//! Causal attention of a mixed batch straight over the paged KV block pool.
//!
//! A batch is T query tokens in S query runs. Run s owns token rows
//! `query_start_loc[s] .. query_start_loc[s + 1]`; its context (cached KV plus this query) has
//! `seq_lens[s]` tokens, the query sitting at its end, so query token i of a run of length n
//! attends to key positions `0 ..= seq_lens[s] - n + i`. Prefill chunks, decodes (n = 1) and
//! 1 + k verification runs are all such runs. Key position p of run s lives in block
//! `block_table[s, p / block_size]` at offset `p % block_size` of the cache
//! `[2 (k | v), num_blocks, block_size, num_kv_heads, head_dim]`: the kernel reads it there, with
//! no gather copy.
//!
//! Work is split into items (run, kv head, tile of query tokens): one item serves every query
//! head of its kv head (GQA: each key row is loaded once for the whole group) and every query
//! token of its tile, so a K/V row feeds `group * tile` query rows. Items run on a rayon pool
//! (`threads`); within an item, keys stream in chunks through an online softmax (running max
//! and sum per query row, accumulator rescaled when the max grows), in f32 whatever the element
//! type, with the vector primitives of the instruction set chosen at run time (`simd`).
//!
//! Token trees: a run may carry tree masks ([`BatchLayout::set_tree_masks`]). For a token with
//! `tree_mask[t] != 0` of run s, key position p is visible iff `p < tree_start[s]`, or bit
//! `p - tree_start[s]` (< 64) of its mask is set; every other token is causal as above. Items of
//! runs without tree tokens take exactly the causal code path; tree items add one bit test per
//! (row, key) of the <= 64 keys from `tree_start[s]` on.
//!
//! Per-layer options ([`AttentionOptions`], [`paged_attention_with`]): a sliding window W (a
//! query at position p sees keys p - W < j <= p; a tree token's p is its logical position
//! `tree_start + popcount(mask) - 1`, the window applies to its prefix keys and its in-tree keys
//! keep the tree rule) narrows the keys a row visits: items start at the key chunk holding
//! their rows' smallest bound (chunks stay aligned to multiples of the chunk size, so a row's
//! arithmetic does not depend on its item), and rows mask keys below their own bound in the
//! chunks where it falls. A soft-cap c replaces each score s (scale included) by c tanh(s / c)
//! before masking and softmax (vector exp, lane by lane). A call without options runs item
//! functions compiled without the options' code (a const parameter chosen once per call): with
//! it inlined, the row-parallel path ran 1.4-1.5x slower on AVX2 even when it did not run.
//!
//! Costs: O(sum over runs of n * seq_len * num_heads * head_dim) arithmetic, reading each K/V row
//! of a run once per (kv head, query tile); scratch O(tile rows * head_dim) per item.

use std::fmt;

use crate::elem::Elem;
#[cfg(target_arch = "x86_64")]
use crate::simd::{Avx2, Avx512};
use crate::simd::{Isa, Lanes, Rows, Scalar};
use crate::threads;

/// Keys per online-softmax chunk.
const KEY_CHUNK: usize = 32;
/// Query rows (tokens x heads of a group) an item aims for: enough reuse of each K/V row,
/// small enough that long prefills split into many items (twice this with AVX-512: 4 vectors).
const TILE_ROWS: usize = 32;

/// A bad argument, naming the field at fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttentionError {
    pub field: &'static str,
    pub message: String,
}

impl fmt::Display for AttentionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

impl std::error::Error for AttentionError {}

fn err<T>(field: &'static str, message: impl Into<String>) -> Result<T, AttentionError> {
    Err(AttentionError {
        field,
        message: message.into(),
    })
}

/// Head counts and the cache's geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadGeometry {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub num_blocks: usize,
}

impl HeadGeometry {
    fn validate(&self) -> Result<(), AttentionError> {
        if self.num_heads == 0
            || self.num_kv_heads == 0
            || self.head_dim == 0
            || self.block_size == 0
        {
            return err("geometry", format!("every size must be >= 1, got {self:?}"));
        }
        if self.num_heads % self.num_kv_heads != 0 {
            return err(
                "num_heads",
                format!(
                    "{} is not a multiple of num_kv_heads {}",
                    self.num_heads, self.num_kv_heads
                ),
            );
        }
        Ok(())
    }

    /// Elements of one half (k or v) of the cache.
    pub fn cache_half_len(&self) -> usize {
        self.num_blocks * self.block_size * self.num_kv_heads * self.head_dim
    }
}

/// Per-layer options of [`paged_attention_with`] (see the module doc); the default is plain
/// causal attention.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttentionOptions {
    /// Sliding window W >= 1: a query at position p sees keys p - W < j <= p. None: every key.
    pub window: Option<usize>,
    /// Soft-cap c > 0 (finite): a score s becomes c * tanh(s / c). None: no cap.
    pub softcap: Option<f32>,
}

impl AttentionOptions {
    fn validate(&self) -> Result<(), AttentionError> {
        if self.window == Some(0) {
            return err("window", "must be >= 1 (None: no window)");
        }
        if let Some(c) = self.softcap {
            if !(c.is_finite() && c > 0.0) {
                return err("softcap", format!("must be finite and > 0, got {c}"));
            }
        }
        Ok(())
    }
}

/// A `[num_tokens, num_heads, head_dim]` view with unit stride along head_dim (torch views of a
/// fused qkv tensor have a token stride larger than `num_heads * head_dim`).
#[derive(Clone, Copy, Debug)]
pub struct StridedHeads<'a, E> {
    pub data: &'a [E],
    pub num_tokens: usize,
    pub num_heads: usize,
    pub head_dim: usize,
    pub token_stride: usize,
    pub head_stride: usize,
}

impl<'a, E> StridedHeads<'a, E> {
    /// Elements from the first to one past the last element addressed.
    pub fn extent(
        num_tokens: usize,
        num_heads: usize,
        head_dim: usize,
        token_stride: usize,
        head_stride: usize,
    ) -> usize {
        if num_tokens == 0 || num_heads == 0 || head_dim == 0 {
            return 0;
        }
        (num_tokens - 1) * token_stride + (num_heads - 1) * head_stride + head_dim
    }

    fn validate(
        &self,
        field: &'static str,
        num_tokens: usize,
        num_heads: usize,
        head_dim: usize,
    ) -> Result<(), AttentionError> {
        if (self.num_tokens, self.num_heads, self.head_dim) != (num_tokens, num_heads, head_dim) {
            return err(
                field,
                format!(
                    "shape [{}, {}, {}], expected [{num_tokens}, {num_heads}, {head_dim}]",
                    self.num_tokens, self.num_heads, self.head_dim
                ),
            );
        }
        let need = Self::extent(
            self.num_tokens,
            self.num_heads,
            self.head_dim,
            self.token_stride,
            self.head_stride,
        );
        if self.data.len() < need {
            return err(
                field,
                format!(
                    "strides address {need} elements, the buffer has {}",
                    self.data.len()
                ),
            );
        }
        Ok(())
    }

    #[inline(always)]
    fn row(&self, token: usize, head: usize) -> &'a [E] {
        let start = token * self.token_stride + head * self.head_stride;
        &self.data[start..start + self.head_dim]
    }
}

use layout::{tree_limit, tree_visible};
pub use layout::{BatchLayout, TREE_SLOTS};

/// Write the batch's new keys and values (`k`, `v`: `[T, num_kv_heads, head_dim]`) into their
/// slots of `cache` (`[2, num_blocks, block_size, num_kv_heads, head_dim]`).
pub fn store_kv<E: Elem>(
    layout: &BatchLayout,
    geo: &HeadGeometry,
    k: StridedHeads<'_, E>,
    v: StridedHeads<'_, E>,
    cache: &mut [E],
) -> Result<(), AttentionError> {
    layout.check_cache(geo)?;
    let (t, hkv, d) = (layout.num_tokens(), geo.num_kv_heads, geo.head_dim);
    k.validate("k", t, hkv, d)?;
    v.validate("v", t, hkv, d)?;
    let half = geo.cache_half_len();
    if cache.len() != 2 * half {
        return err(
            "kv_cache",
            format!("has {} elements, expected {}", cache.len(), 2 * half),
        );
    }
    let (kc, vc) = cache.split_at_mut(half);
    for (tok, &slot) in layout.slot_mapping.iter().enumerate() {
        let base = slot as usize * hkv * d;
        for h in 0..hkv {
            let dst = base + h * d;
            kc[dst..dst + d].copy_from_slice(k.row(tok, h));
            vc[dst..dst + d].copy_from_slice(v.row(tok, h));
        }
    }
    Ok(())
}

/// Attend every query token of the batch (`q`: `[T, num_heads, head_dim]`) causally over its
/// run's context in `cache`, writing `out` (`[T, num_heads, head_dim]`, contiguous).
/// `num_threads` <= 1 runs on the calling thread.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention<E: Elem>(
    isa: Isa,
    num_threads: usize,
    layout: &BatchLayout,
    geo: &HeadGeometry,
    q: StridedHeads<'_, E>,
    cache: &[E],
    out: &mut [E],
    scale: f32,
) -> Result<(), AttentionError> {
    let opts = AttentionOptions::default();
    paged_attention_with(isa, num_threads, layout, geo, q, cache, out, scale, opts)
}

/// [`paged_attention`] with a layer's options: a sliding window and/or a soft-cap.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_with<E: Elem>(
    isa: Isa,
    num_threads: usize,
    layout: &BatchLayout,
    geo: &HeadGeometry,
    q: StridedHeads<'_, E>,
    cache: &[E],
    out: &mut [E],
    scale: f32,
    opts: AttentionOptions,
) -> Result<(), AttentionError> {
    layout.check_cache(geo)?;
    opts.validate()?;
    if !isa.is_supported() {
        return err(
            "isa",
            format!("{} is not supported by this CPU", isa.name()),
        );
    }
    let (t, h, d) = (layout.num_tokens(), geo.num_heads, geo.head_dim);
    q.validate("q", t, h, d)?;
    if out.len() != t * h * d {
        return err(
            "out",
            format!("has {} elements, expected {t} x {h} x {d}", out.len()),
        );
    }
    let half = geo.cache_half_len();
    if cache.len() != 2 * half {
        return err(
            "kv_cache",
            format!("has {} elements, expected {}", cache.len(), 2 * half),
        );
    }
    let group = h / geo.num_kv_heads;
    let tile_rows = if isa == Isa::Avx512 {
        2 * TILE_ROWS
    } else {
        TILE_ROWS
    };
    let tile = (tile_rows / group).max(1);
    let mut items = Vec::new();
    for s in (0..layout.num_seqs()).filter(|&s| !layout.skip[s]) {
        let n = (layout.query_start_loc[s + 1] - layout.query_start_loc[s]) as usize;
        for kv_head in 0..geo.num_kv_heads {
            for q0 in (0..n).step_by(tile) {
                items.push(Item {
                    seq: s,
                    kv_head,
                    q0,
                    q1: (q0 + tile).min(n),
                });
            }
        }
    }
    let (k_cache, v_cache) = cache.split_at(half);
    let ctx = Ctx {
        layout,
        geo: *geo,
        group,
        q,
        k_cache,
        v_cache,
        scale,
        window: opts.window,
        softcap: opts.softcap,
    };
    let out = OutPtr(out.as_mut_ptr());
    let run: ItemFn<E> = item_fn::<E>(isa, opts != AttentionOptions::default());
    // SAFETY: `run` matches `isa`, which the CPU supports (checked above); every item writes
    // only its own (token, head) rows of `out`, so items never write the same element.
    threads::for_each_item(num_threads, &items, |it| unsafe { run(&ctx, it, out) });
    Ok(())
}

/// Keys whose scores the row-parallel path computes together.
const QK_KEYS: usize = 4;
/// Query rows whose P V the row-parallel path accumulates together (head_dim <= 4 vectors).
const PV_ROWS: usize = 4;

/// Query tokens `q0 .. q1` (within the run) of run `seq`, every query head of `kv_head`.
#[derive(Clone, Copy, Debug)]
struct Item {
    seq: usize,
    kv_head: usize,
    q0: usize,
    q1: usize,
}

struct Ctx<'a, E> {
    layout: &'a BatchLayout,
    geo: HeadGeometry,
    group: usize,
    q: StridedHeads<'a, E>,
    k_cache: &'a [E],
    v_cache: &'a [E],
    scale: f32,
    window: Option<usize>,
    softcap: Option<f32>,
}

#[derive(Clone, Copy)]
struct OutPtr<E>(*mut E);
// SAFETY: items write disjoint rows (see paged_attention).
unsafe impl<E> Send for OutPtr<E> {}
unsafe impl<E> Sync for OutPtr<E> {}

type ItemFn<E> = unsafe fn(&Ctx<'_, E>, &Item, OutPtr<E>);

/// The item function of an instruction set. OPTS (a call with a window or a soft-cap) selects
/// the item paths compiled with the options' code; without them every path is compiled as if
/// they did not exist (the option code neither runs nor shapes the loops' register allocation).
fn item_fn<E: Elem>(isa: Isa, opts: bool) -> ItemFn<E> {
    match (isa, opts) {
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, false) => item_avx512::<E, false>,
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, true) => item_avx512::<E, true>,
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, false) => item_avx2::<E, false>,
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, true) => item_avx2::<E, true>,
        (_, false) => item_scalar::<E, false>,
        (_, true) => item_scalar::<E, true>,
    }
}

/// The layer options an item path compiled with (OPTS) or without them sees.
#[inline(always)]
fn options<E, const OPTS: bool>(ctx: &Ctx<'_, E>) -> (Option<usize>, Option<f32>) {
    if OPTS {
        (ctx.window, ctx.softcap)
    } else {
        (None, None)
    }
}

unsafe fn item_scalar<E: Elem, const OPTS: bool>(ctx: &Ctx<'_, E>, it: &Item, out: OutPtr<E>) {
    attend_item::<E, Scalar, OPTS>(ctx, it, out)
}

/// The row-parallel path once an item has at least half a vector of rows (verification runs,
/// prefill tiles, wide GQA groups); the per-row dot path below that (decodes).
#[inline(always)]
unsafe fn attend<E: Elem, L: Lanes + Rows + PvOutlined + CapOutlined, const OPTS: bool>(
    ctx: &Ctx<'_, E>,
    it: &Item,
    out: OutPtr<E>,
) {
    // batch-invariant mode: every item on the per-row path (a row computed alike in any item)
    if L::W > 1 && 2 * (it.q1 - it.q0) * ctx.group >= L::W && !ctx.layout.batch_invariant {
        attend_item_rows::<E, L, OPTS>(ctx, it, out)
    } else {
        attend_item::<E, L, OPTS>(ctx, it, out)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn item_avx2<E: Elem, const OPTS: bool>(ctx: &Ctx<'_, E>, it: &Item, out: OutPtr<E>) {
    attend::<E, Avx2, OPTS>(ctx, it, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn item_avx512<E: Elem, const OPTS: bool>(ctx: &Ctx<'_, E>, it: &Item, out: OutPtr<E>) {
    use few_rows::{attend_few_rows as few, MAX_ROWS as M, SHORT_ROWS as S};
    let short = (it.q1 - it.q0) * ctx.group <= S;
    match (few_rows::vectors_per_row(ctx, it), short) {
        (Some(_), false) if !ctx.layout.batch_invariant => attend::<E, Avx512, OPTS>(ctx, it, out),
        (Some(2), true) => few::<E, 2, S, OPTS>(ctx, it, out),
        (Some(4), true) => few::<E, 4, S, OPTS>(ctx, it, out),
        (Some(8), true) => few::<E, 8, S, OPTS>(ctx, it, out),
        (Some(2), false) => few::<E, 2, M, OPTS>(ctx, it, out),
        (Some(4), false) => few::<E, 4, M, OPTS>(ctx, it, out),
        (Some(8), false) => few::<E, 8, M, OPTS>(ctx, it, out),
        _ => attend::<E, Avx512, OPTS>(ctx, it, out),
    }
}

/// One item: online softmax over key chunks. Rows r = i * group + j (query token i of the
/// tile, head j of the group); row r sees key positions lo[r] ..= limit[r] (lo: 0 without a
/// window).
#[inline(always)]
unsafe fn attend_item<E: Elem, L: Lanes + Rows + CapOutlined, const OPTS: bool>(
    ctx: &Ctx<'_, E>,
    it: &Item,
    out: OutPtr<E>,
) {
    let (window, softcap) = options::<E, OPTS>(ctx);
    let (d, g, hkv, bs) = (
        ctx.geo.head_dim,
        ctx.group,
        ctx.geo.num_kv_heads,
        ctx.geo.block_size,
    );
    let lay = ctx.layout;
    let start = lay.query_start_loc[it.seq] as usize;
    let n = lay.query_start_loc[it.seq + 1] as usize - start;
    let context_start = lay.seq_lens[it.seq] as usize - n; // position of the run's first query token
    let table = &lay.block_table[it.seq * lay.table_width..(it.seq + 1) * lay.table_width];
    let rows = (it.q1 - it.q0) * g;
    let mut scratch = vec![0.0f32; d];
    let mut qt = vec![0.0f32; rows * d]; // scaled queries, [rows, d]
    let mut limit = vec![0usize; rows];
    for i in 0..it.q1 - it.q0 {
        for j in 0..g {
            let r = i * g + j;
            let src = E::row(
                ctx.q.row(start + it.q0 + i, it.kv_head * g + j),
                &mut scratch,
            );
            for (dst, x) in qt[r * d..(r + 1) * d].iter_mut().zip(src) {
                *dst = x * ctx.scale;
            }
            limit[r] = context_start + it.q0 + i;
        }
    }
    let tree = item_tree(ctx, it, start, &mut limit, rows);
    let num_keys = match &tree {
        None => context_start + it.q1, // keys 0 .. num_keys-1 are visible to some row
        Some(_) => limit.iter().max().map_or(0, |&l| l + 1),
    };
    let mut lo = Vec::new(); // sliding window: the first key each row sees
    let (first_key, max_lo) = match window {
        None => (0, 0),
        Some(w) => {
            lo.resize(rows, 0);
            let tree_rows = tree.as_ref().map(|(ts, masks)| (*ts, &masks[..]));
            let first = context_start + it.q0;
            let (min, max) = window_starts(w, g, first, it.q1 - it.q0, tree_rows, &mut lo);
            (min / KEY_CHUNK * KEY_CHUNK, max)
        }
    };
    let mut acc = vec![0.0f32; rows * d];
    let mut run_max = vec![f32::NEG_INFINITY; rows];
    let mut run_sum = vec![0.0f32; rows];
    let mut p = vec![0.0f32; rows * KEY_CHUNK]; // scores, then probabilities, [rows, KEY_CHUNK]
    let mut offsets = [0usize; KEY_CHUNK]; // cache offset of each key row of a chunk
    for k0 in (first_key..num_keys).step_by(KEY_CHUNK) {
        let kn = KEY_CHUNK.min(num_keys - k0);
        let below = k0 < max_lo; // some row's window starts past this chunk's first key
        chunk_offsets(&mut offsets[..kn], table, k0, bs, hkv, it.kv_head, d);
        for c in 0..kn {
            let off = offsets[c];
            let krow = E::row(&ctx.k_cache[off..off + d], &mut scratch);
            for r in 0..rows {
                let visible = k0 + c <= limit[r]
                    && (!below || k0 + c >= lo[r])
                    && match &tree {
                        None => true,
                        Some((ts, masks)) => masks[r] == 0 || tree_visible(masks[r], *ts, k0 + c),
                    };
                p[r * KEY_CHUNK + c] = if visible {
                    L::dot(&qt[r * d..(r + 1) * d], krow)
                } else {
                    f32::NEG_INFINITY
                };
            }
        }
        if let Some(cap) = softcap {
            // the whole chunk width, each key in the lane of its chunk position whatever the
            // item (lanes past kn are set to -inf below); masked keys stay -inf
            L::soft_cap_outlined::<true>(&mut p[..rows * KEY_CHUNK], cap);
        }
        for r in 0..rows {
            // the softmax runs over the whole chunk width, keys past kn at -inf (exp: 0), so a
            // row's arithmetic does not depend on where its item's keys end (batch invariance)
            p[r * KEY_CHUNK + kn..(r + 1) * KEY_CHUNK].fill(f32::NEG_INFINITY);
            let pr = &mut p[r * KEY_CHUNK..(r + 1) * KEY_CHUNK];
            let chunk_max = pr.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            if chunk_max == f32::NEG_INFINITY {
                pr.fill(0.0); // every key of the chunk is in this row's future
                continue;
            }
            let new_max = run_max[r].max(chunk_max);
            if new_max > run_max[r] && run_sum[r] > 0.0 {
                let correction = (run_max[r] - new_max).exp();
                run_sum[r] *= correction;
                L::scale(&mut acc[r * d..(r + 1) * d], correction);
            }
            run_max[r] = new_max;
            run_sum[r] += exp_shifted::<L>(pr, new_max); // masked: exp(-inf) = 0
        }
        for c in 0..kn {
            let off = offsets[c];
            let vrow = E::row(&ctx.v_cache[off..off + d], &mut scratch);
            for r in 0..rows {
                let w = p[r * KEY_CHUNK + c];
                if w != 0.0 {
                    L::axpy(&mut acc[r * d..(r + 1) * d], w, vrow);
                }
            }
        }
    }
    let h = ctx.geo.num_heads;
    for i in 0..it.q1 - it.q0 {
        for j in 0..g {
            let r = i * g + j;
            let inv = 1.0 / run_sum[r]; // > 0: every row sees a key (its own position, a tree row its mask)
            let dst = out
                .0
                .add(((start + it.q0 + i) * h + it.kv_head * g + j) * d);
            for (e, &a) in acc[r * d..(r + 1) * d].iter().enumerate() {
                *dst.add(e) = E::from_f32(a * inv);
            }
        }
    }
}

/// One item, lanes over query rows: scores of a key chunk for W rows at once from the
/// transposed query tile (no horizontal sums), then the online softmax vectorized across rows
/// with a vector exp. Same rows and masks as `attend_item`.
#[inline(always)]
unsafe fn attend_item_rows<
    E: Elem,
    L: Lanes + Rows + PvOutlined + CapOutlined,
    const OPTS: bool,
>(
    ctx: &Ctx<'_, E>,
    it: &Item,
    out: OutPtr<E>,
) {
    let (window, softcap) = options::<E, OPTS>(ctx);
    let (d, g, hkv, bs, w) = (
        ctx.geo.head_dim,
        ctx.group,
        ctx.geo.num_kv_heads,
        ctx.geo.block_size,
        L::W,
    );
    let lay = ctx.layout;
    let start = lay.query_start_loc[it.seq] as usize;
    let n = lay.query_start_loc[it.seq + 1] as usize - start;
    let context_start = lay.seq_lens[it.seq] as usize - n;
    let table = &lay.block_table[it.seq * lay.table_width..(it.seq + 1) * lay.table_width];
    let rows = (it.q1 - it.q0) * g;
    let mp = rows.div_ceil(w) * w; // rows padded to whole vectors; padding rows see every key
    let mut scratch = vec![0.0f32; d];
    let mut qt = vec![0.0f32; d * mp]; // scaled queries transposed, [d, mp]
    let mut limit = vec![usize::MAX; mp];
    for i in 0..it.q1 - it.q0 {
        for j in 0..g {
            let r = i * g + j;
            let src = E::row(
                ctx.q.row(start + it.q0 + i, it.kv_head * g + j),
                &mut scratch,
            );
            for (e, x) in src.iter().enumerate() {
                qt[e * mp + r] = x * ctx.scale;
            }
            limit[r] = context_start + it.q0 + i;
        }
    }
    let tree = item_tree(ctx, it, start, &mut limit, mp);
    let (first_limit, num_keys) = match &tree {
        // the smallest limit (the tile's first token), keys any row sees
        None => (context_start + it.q0, context_start + it.q1),
        Some(_) => (
            limit[..rows].iter().copied().min().unwrap_or(0),
            limit[..rows].iter().max().map_or(0, |&l| l + 1),
        ),
    };
    let mut lo = Vec::new(); // sliding window: the first key each row sees (padding rows: 0)
    let (first_key, max_lo) = match window {
        None => (0, 0),
        Some(w) => {
            lo.resize(mp, 0);
            let tree_rows = tree.as_ref().map(|(ts, masks)| (*ts, &masks[..]));
            let first = context_start + it.q0;
            let (min, max) = window_starts(w, g, first, it.q1 - it.q0, tree_rows, &mut lo);
            (min / KEY_CHUNK * KEY_CHUNK, max)
        }
    };
    let mut acc = vec![0.0f32; rows * d];
    // a window may leave a row no key in the item's first chunks: a finite floor keeps its
    // running max and correction free of -inf - -inf (without a window key 0 is visible to all)
    let floor = if window.is_some() {
        f32::MIN
    } else {
        f32::NEG_INFINITY
    };
    let mut run_max = vec![floor; mp];
    let mut run_sum = vec![0.0f32; mp];
    let mut correction = vec![1.0f32; mp];
    let mut p = vec![0.0f32; KEY_CHUNK * mp]; // scores, then probabilities, [KEY_CHUNK, mp]
    let mut vchunk = vec![0.0f32; KEY_CHUNK * d]; // V rows of a chunk as f32 (non-f32 caches)
    let mut kchunk = vec![0.0f32; KEY_CHUNK * d]; // K rows of a chunk as f32 (non-f32 caches)
    let mut offsets = [0usize; KEY_CHUNK]; // cache offset of each key row of a chunk
    let qp = qt.as_ptr();
    let pp = p.as_mut_ptr();
    for k0 in (first_key..num_keys).step_by(KEY_CHUNK) {
        let kn = KEY_CHUNK.min(num_keys - k0);
        chunk_offsets(&mut offsets[..kn], table, k0, bs, hkv, it.kv_head, d);
        // the chunk's K rows as f32 first (a copy for non-f32 caches), then the scores, QK_KEYS
        // keys at a time (each query vector loaded once for all of them)
        let mut krows = [std::ptr::null::<f32>(); KEY_CHUNK];
        for (c, slot) in kchunk.chunks_mut(d).take(kn).enumerate() {
            let off = offsets[c];
            krows[c] = E::row(&ctx.k_cache[off..off + d], slot).as_ptr();
        }
        let mut c = 0;
        while c + QK_KEYS <= kn {
            let group: &[*const f32; QK_KEYS] = krows[c..c + QK_KEYS].try_into().unwrap();
            scores_of_keys::<L, QK_KEYS>(group, qp, mp, d, pp.add(c * mp));
            c += QK_KEYS;
        }
        while c < kn {
            scores_of_keys::<L, 1>(&[krows[c]], qp, mp, d, pp.add(c * mp));
            c += 1;
        }
        if let Some(cap) = softcap {
            L::soft_cap_outlined::<false>(&mut p[..kn * mp], cap);
        }
        if k0 + kn - 1 > first_limit {
            for c in 0..kn {
                let pos = k0 + c;
                for r in 0..rows {
                    if pos > limit[r] {
                        p[c * mp + r] = f32::NEG_INFINITY;
                    }
                }
            }
        }
        if k0 < max_lo {
            for c in 0..kn.min(max_lo - k0) {
                let pos = k0 + c;
                for r in 0..rows {
                    if pos < lo[r] {
                        p[c * mp + r] = f32::NEG_INFINITY;
                    }
                }
            }
        }
        if let Some((ts, masks)) = &tree {
            // keys ts .. ts + 64 of this chunk: tree rows see only their mask's bits
            let (lo, hi) = (k0.max(*ts), (k0 + kn).min(ts + TREE_SLOTS));
            for pos in lo..hi {
                let c = pos - k0;
                for r in 0..rows {
                    if masks[r] != 0 && (masks[r] >> (pos - ts)) & 1 == 0 {
                        p[c * mp + r] = f32::NEG_INFINITY;
                    }
                }
            }
        }
        for v in (0..mp).step_by(w) {
            let mut chunk_max = L::splat(f32::NEG_INFINITY);
            for c in 0..kn {
                chunk_max = L::max(chunk_max, L::load(pp.add(c * mp + v)));
            }
            let old = L::load(run_max.as_ptr().add(v));
            let new = L::max(old, chunk_max); // finite: key 0 is visible to every row, or the floor
            L::store(run_max.as_mut_ptr().add(v), new);
            let corr = L::exp(L::sub(old, new)); // first chunk: exp(-inf) = 0
            L::store(correction.as_mut_ptr().add(v), corr);
            let mut sum = L::splat(0.0);
            for c in 0..kn {
                let e = L::exp(L::sub(L::load(pp.add(c * mp + v)), new)); // masked: 0
                L::store(pp.add(c * mp + v), e);
                sum = L::add(sum, e);
            }
            let l = L::load(run_sum.as_ptr().add(v));
            L::store(run_sum.as_mut_ptr().add(v), L::fma(l, corr, sum));
        }
        if k0 > first_key {
            for r in 0..rows {
                if correction[r] != 1.0 {
                    <L as Lanes>::scale(&mut acc[r * d..(r + 1) * d], correction[r]);
                }
            }
        }
        let mut vrows: [&[f32]; KEY_CHUNK] = [&[]; KEY_CHUNK];
        for (c, slot) in vchunk.chunks_mut(d).take(kn).enumerate() {
            let off = offsets[c];
            vrows[c] = E::row(&ctx.v_cache[off..off + d], slot);
        }
        let probs = &p[..kn * mp];
        match d / w {
            _ if d % w != 0 => pv_axpy::<L>(&mut acc, probs, &vrows[..kn], rows, mp, d),
            1 => L::pv_block_outlined::<1>(&mut acc, probs, &vrows[..kn], rows, mp),
            2 => L::pv_block_outlined::<2>(&mut acc, probs, &vrows[..kn], rows, mp),
            4 => L::pv_block_outlined::<4>(&mut acc, probs, &vrows[..kn], rows, mp),
            8 => L::pv_block_outlined::<8>(&mut acc, probs, &vrows[..kn], rows, mp),
            _ => pv_axpy::<L>(&mut acc, probs, &vrows[..kn], rows, mp, d),
        }
    }
    let h = ctx.geo.num_heads;
    for i in 0..it.q1 - it.q0 {
        for j in 0..g {
            let r = i * g + j;
            let inv = 1.0 / run_sum[r];
            let dst = out
                .0
                .add(((start + it.q0 + i) * h + it.kv_head * g + j) * d);
            for (e, &a) in acc[r * d..(r + 1) * d].iter().enumerate() {
                *dst.add(e) = E::from_f32(a * inv);
            }
        }
    }
}

/// The item's tree, when its run has tree tokens: (root position, mask per row r = i * group + j,
/// `rows_padded` long, 0 for causal and padding rows). Tree rows' `limit` becomes their last
/// visible key.
fn item_tree<E>(
    ctx: &Ctx<'_, E>,
    it: &Item,
    start: usize,
    limit: &mut [usize],
    rows_padded: usize,
) -> Option<(usize, Vec<u64>)> {
    let tree = ctx.layout.tree.as_ref()?;
    if !tree.has_tree[it.seq] {
        return None;
    }
    let (g, ts) = (ctx.group, tree.start[it.seq]);
    let seq_len = ctx.layout.seq_lens[it.seq] as usize;
    let mut masks = vec![0u64; rows_padded];
    for i in 0..it.q1 - it.q0 {
        let m = tree.mask[start + it.q0 + i];
        if m != 0 {
            for j in 0..g {
                masks[i * g + j] = m;
                limit[i * g + j] = tree_limit(m, ts, seq_len);
            }
        }
    }
    Some((ts, masks))
}

/// Sliding window `w`: the first key position each row r = i * group + j of an item sees, into
/// `lo` (query tokens i < tokens, the first at KV position `first_pos`); returns (the smallest,
/// the largest). A causal row at position p sees keys after p - w. A tree row (mask != 0 in
/// `tree` = (root position, mask per row)) at logical position p = root + popcount(mask) - 1
/// sees prefix keys after p - w and its in-tree keys by bit: its bound is at most the root.
fn window_starts(
    w: usize,
    group: usize,
    first_pos: usize,
    tokens: usize,
    tree: Option<(usize, &[u64])>,
    lo: &mut [usize],
) -> (usize, usize) {
    let (mut min, mut max) = (usize::MAX, 0);
    for i in 0..tokens {
        for j in 0..group {
            let r = i * group + j;
            let b = match tree {
                Some((ts, masks)) if masks[r] != 0 => (ts + masks[r].count_ones() as usize)
                    .saturating_sub(w)
                    .min(ts),
                _ => (first_pos + i + 1).saturating_sub(w),
            };
            lo[r] = b;
            min = min.min(b);
            max = max.max(b);
        }
    }
    (min, max)
}

/// What the soft-cap needs beyond [`Rows`]: a blend keeping -inf lanes.
trait CapRows: Rows {
    /// Lanes of `orig` that are -inf (masked keys), the other lanes of `capped`.
    unsafe fn keep_neg_inf(orig: Self::V, capped: Self::V) -> Self::V;
}

impl CapRows for Scalar {
    #[inline(always)]
    unsafe fn keep_neg_inf(orig: f32, capped: f32) -> f32 {
        if orig == f32::NEG_INFINITY {
            orig
        } else {
            capped
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl CapRows for Avx2 {
    #[inline(always)]
    unsafe fn keep_neg_inf(orig: Self::V, capped: Self::V) -> Self::V {
        use std::arch::x86_64::*;
        let masked = _mm256_cmp_ps::<_CMP_EQ_OQ>(orig, _mm256_set1_ps(f32::NEG_INFINITY));
        _mm256_blendv_ps(capped, orig, masked)
    }
}

#[cfg(target_arch = "x86_64")]
impl CapRows for Avx512 {
    #[inline(always)]
    unsafe fn keep_neg_inf(orig: Self::V, capped: Self::V) -> Self::V {
        use std::arch::x86_64::*;
        let masked = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(orig, _mm512_set1_ps(f32::NEG_INFINITY));
        _mm512_mask_blend_ps(masked, capped, orig)
    }
}

/// [`soft_cap`] compiled as a function of its own per instruction set, so that the item loops
/// calling it keep the register allocation they have without it (see [`PvOutlined`]).
trait CapOutlined: Rows {
    unsafe fn soft_cap_outlined<const KEEP_MASKED: bool>(x: &mut [f32], cap: f32);
}

impl CapOutlined for Scalar {
    #[inline(never)]
    unsafe fn soft_cap_outlined<const KEEP_MASKED: bool>(x: &mut [f32], cap: f32) {
        soft_cap::<Scalar, KEEP_MASKED>(x, cap)
    }
}

/// CapOutlined for a vector `Lanes` type: a `#[target_feature]` function holding its soft_cap.
macro_rules! cap_outlined {
    ($lanes:ty, $features:literal, $func:ident) => {
        #[cfg(target_arch = "x86_64")]
        impl CapOutlined for $lanes {
            unsafe fn soft_cap_outlined<const KEEP_MASKED: bool>(x: &mut [f32], cap: f32) {
                $func::<KEEP_MASKED>(x, cap)
            }
        }

        #[cfg(target_arch = "x86_64")]
        #[inline(never)]
        #[target_feature(enable = $features)]
        unsafe fn $func<const KEEP_MASKED: bool>(x: &mut [f32], cap: f32) {
            soft_cap::<$lanes, KEEP_MASKED>(x, cap)
        }
    };
}

cap_outlined!(Avx2, "avx2,fma", soft_cap_avx2);
cap_outlined!(Avx512, "avx512f", soft_cap_avx512);

/// x = cap * tanh(x / cap) in place, as cap - 2 cap / (exp(2 x / cap) + 1) with the vector exp
/// (no NaN: exp overflows to inf, giving cap; -inf gives -cap, or stays -inf with KEEP_MASKED:
/// scores already masked); x.len() is a multiple of W. Absolute error about cap * 2^-23 next
/// to 0. Each lane's result depends on its value only.
#[inline(always)]
unsafe fn soft_cap<L: Rows + CapRows, const KEEP_MASKED: bool>(x: &mut [f32], cap: f32) {
    debug_assert!(x.len() % L::W == 0);
    let (c, k, c2, one) = (
        L::splat(cap),
        L::splat(2.0 / cap),
        L::splat(2.0 * cap),
        L::splat(1.0),
    );
    let p = x.as_mut_ptr();
    for i in (0..x.len()).step_by(L::W) {
        let s = L::load(p.add(i));
        let e = L::exp(L::mul(s, k));
        let capped = L::sub(c, L::div(c2, L::add(e, one)));
        L::store(
            p.add(i),
            if KEEP_MASKED {
                L::keep_neg_inf(s, capped)
            } else {
                capped
            },
        );
    }
}

/// Cache offsets of key rows k0 .. k0 + out.len() of one kv head: one division per chunk,
/// then (block, offset) stepped along the block table.
#[inline(always)]
fn chunk_offsets(
    out: &mut [usize],
    table: &[i32],
    k0: usize,
    bs: usize,
    hkv: usize,
    kv_head: usize,
    d: usize,
) {
    let (mut blk, mut off) = (k0 / bs, k0 % bs);
    let mut base = table[blk] as usize * bs;
    for o in out.iter_mut() {
        *o = ((base + off) * hkv + kv_head) * d;
        off += 1;
        if off == bs {
            off = 0;
            blk += 1;
            if blk < table.len() {
                base = table[blk] as usize * bs;
            }
        }
    }
}

/// x = exp(x - shift) in place, vector by vector; returns the sum.
#[inline(always)]
unsafe fn exp_shifted<L: Rows>(x: &mut [f32], shift: f32) -> f32 {
    let (w, n) = (L::W, x.len());
    let p = x.as_mut_ptr();
    let s = L::splat(shift);
    let mut acc = L::splat(0.0);
    let mut i = 0;
    while i + w <= n {
        let e = L::exp(L::sub(L::load(p.add(i)), s));
        L::store(p.add(i), e);
        acc = L::add(acc, e);
        i += w;
    }
    let mut lanes = [0.0f32; 16];
    L::store(lanes.as_mut_ptr(), acc); // W <= 16
    let mut sum: f32 = lanes[..w].iter().sum();
    while i < n {
        *p.add(i) = (*p.add(i) - shift).exp();
        sum += *p.add(i);
        i += 1;
    }
    sum
}

/// [`pv_block`] compiled as a function of its own per instruction set: inlined into the
/// row-parallel item, its accumulators competed for registers with the constants the item's
/// softmax keeps live, and LLVM kept half of them on the stack (a load and a store around
/// every FMA).
trait PvOutlined: Rows {
    unsafe fn pv_block_outlined<const NV: usize>(
        acc: &mut [f32],
        probs: &[f32],
        v: &[&[f32]],
        rows: usize,
        mp: usize,
    );
}

impl PvOutlined for Scalar {
    #[inline(never)]
    unsafe fn pv_block_outlined<const NV: usize>(
        acc: &mut [f32],
        probs: &[f32],
        v: &[&[f32]],
        rows: usize,
        mp: usize,
    ) {
        pv_block::<Scalar, NV>(acc, probs, v, rows, mp)
    }
}

/// PvOutlined for a vector `Lanes` type: a `#[target_feature]` function holding its pv_block.
macro_rules! pv_outlined {
    ($lanes:ty, $features:literal, $func:ident) => {
        #[cfg(target_arch = "x86_64")]
        impl PvOutlined for $lanes {
            unsafe fn pv_block_outlined<const NV: usize>(
                acc: &mut [f32],
                probs: &[f32],
                v: &[&[f32]],
                rows: usize,
                mp: usize,
            ) {
                $func::<NV>(acc, probs, v, rows, mp)
            }
        }

        #[cfg(target_arch = "x86_64")]
        #[inline(never)]
        #[target_feature(enable = $features)]
        unsafe fn $func<const NV: usize>(
            acc: &mut [f32],
            probs: &[f32],
            v: &[&[f32]],
            rows: usize,
            mp: usize,
        ) {
            pv_block::<$lanes, NV>(acc, probs, v, rows, mp)
        }
    };
}

pv_outlined!(Avx2, "avx2,fma", pv_block_avx2);
pv_outlined!(Avx512, "avx512f", pv_block_avx512);

/// acc[r] += sum_c probs[c, r] * v[c] with acc[r] held in NV registers across the chunk.
#[inline(always)]
unsafe fn pv_block<L: Rows, const NV: usize>(
    acc: &mut [f32],
    probs: &[f32],
    v: &[&[f32]],
    rows: usize,
    mp: usize,
) {
    // PV_ROWS rows at a time share each V load (and keep enough accumulators in flight: half as
    // many for 8-vector heads); the rest one by one. Each row's sum runs over the same keys in
    // the same order either way.
    let mut r = 0;
    if NV <= 4 {
        while r + PV_ROWS <= rows {
            pv_rows::<L, NV, PV_ROWS>(acc, probs, v, r, mp);
            r += PV_ROWS;
        }
    } else {
        while r + PV_ROWS / 2 <= rows {
            pv_rows::<L, NV, { PV_ROWS / 2 }>(acc, probs, v, r, mp);
            r += PV_ROWS / 2;
        }
    }
    for r in r..rows {
        pv_rows::<L, NV, 1>(acc, probs, v, r, mp);
    }
}

/// Rows r0 .. r0 + RB of pv_block together: RB x NV accumulators, one load per V vector. Raw
/// pointers and no bounds checks in the key loop: with checked slices LLVM kept half the
/// accumulators on the stack (a load and a store around every FMA).
#[inline(always)]
unsafe fn pv_rows<L: Rows, const NV: usize, const RB: usize>(
    acc: &mut [f32],
    probs: &[f32],
    v: &[&[f32]],
    r0: usize,
    mp: usize,
) {
    let w = L::W;
    let d = NV * w;
    debug_assert!(acc.len() >= (r0 + RB) * d && probs.len() >= (v.len().max(1) - 1) * mp + r0 + RB);
    let a = acc.as_mut_ptr().add(r0 * d);
    let mut regs = [[L::splat(0.0); NV]; RB];
    for (b, row) in regs.iter_mut().enumerate() {
        for (i, reg) in row.iter_mut().enumerate() {
            *reg = L::load(a.add(b * d + i * w));
        }
    }
    let pp = probs.as_ptr().add(r0);
    for (c, vrow) in v.iter().enumerate() {
        let wp = pp.add(c * mp);
        let mut any = false;
        for b in 0..RB {
            any |= *wp.add(b) != 0.0;
        }
        if !any {
            continue; // a key no row of the block sees (adding 0 * v changes no finite sum)
        }
        let vp = vrow.as_ptr();
        let mut vv = [L::splat(0.0); NV];
        for (i, x) in vv.iter_mut().enumerate() {
            *x = L::load(vp.add(i * w));
        }
        for (b, row) in regs.iter_mut().enumerate() {
            let s = L::splat(*wp.add(b));
            for (reg, x) in row.iter_mut().zip(vv) {
                *reg = L::fma(s, x, *reg);
            }
        }
    }
    for (b, row) in regs.iter().enumerate() {
        for (i, reg) in row.iter().enumerate() {
            L::store(a.add(b * d + i * w), *reg);
        }
    }
}

/// Scores of KB keys (rows of d f32s at kp) against every query row: `out[j * mp + r]` = q_r . k_j, with the query rows
/// transposed in `qt` ([d, mp], rows as lanes). Per key the same four partial sums (by dimension
/// mod 4) and the same final additions as one key at a time; the query vectors are loaded once
/// for the KB keys.
#[inline(always)]
unsafe fn scores_of_keys<L: Rows, const KB: usize>(
    kp: &[*const f32; KB],
    qt: *const f32,
    mp: usize,
    d: usize,
    out: *mut f32,
) {
    let w = L::W;
    for v in (0..mp).step_by(w) {
        let base = qt.add(v);
        let mut a: [[L::V; 4]; KB] = [[L::splat(0.0); 4]; KB];
        let mut e = 0;
        while e + 4 <= d {
            let q0 = L::load(base.add(e * mp));
            let q1 = L::load(base.add((e + 1) * mp));
            let q2 = L::load(base.add((e + 2) * mp));
            let q3 = L::load(base.add((e + 3) * mp));
            for j in 0..KB {
                let k = kp[j].add(e);
                a[j][0] = L::fma(L::splat(*k), q0, a[j][0]);
                a[j][1] = L::fma(L::splat(*k.add(1)), q1, a[j][1]);
                a[j][2] = L::fma(L::splat(*k.add(2)), q2, a[j][2]);
                a[j][3] = L::fma(L::splat(*k.add(3)), q3, a[j][3]);
            }
            e += 4;
        }
        while e < d {
            let qv = L::load(base.add(e * mp));
            for j in 0..KB {
                a[j][0] = L::fma(L::splat(*kp[j].add(e)), qv, a[j][0]);
            }
            e += 1;
        }
        for (j, aj) in a.iter().enumerate() {
            L::store(
                out.add(j * mp + v),
                L::add(L::add(aj[0], aj[1]), L::add(aj[2], aj[3])),
            );
        }
    }
}

/// The same for head dims that are not a whole number of vectors.
#[inline(always)]
unsafe fn pv_axpy<L: Lanes>(
    acc: &mut [f32],
    probs: &[f32],
    v: &[&[f32]],
    rows: usize,
    mp: usize,
    d: usize,
) {
    for (c, vrow) in v.iter().enumerate() {
        for r in 0..rows {
            let wgt = probs[c * mp + r];
            if wgt != 0.0 {
                L::axpy(&mut acc[r * d..(r + 1) * d], wgt, vrow);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod few_rows;
mod layout;

#[cfg(test)]
mod tests;
