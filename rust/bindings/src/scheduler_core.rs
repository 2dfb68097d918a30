//! The scheduler core's bindings: `SchedulerCore` (newtype over `specinfer_scheduler::Scheduler`),
//! its step outputs `SchedulerOutput` / `UpdateOutput`, one error map (bad input -> ValueError,
//! call order or broken invariant -> RuntimeError), the GIL released around every core call that
//! does real work, and numpy arrays built from the core's `Vec`s without copying.

use std::sync::{Arc, Mutex};

use numpy::ndarray::ArrayView2;
use numpy::{AllowTypeChange, IntoPyArray, PyArray1, PyArray2, PyArrayLike1};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use specinfer_scheduler as core;
use specinfer_scheduler::{CoreError, Scheduler, SchedulerConfig, StopParams};

fn to_py(err: CoreError) -> PyErr {
    match err {
        CoreError::InvariantViolation(_) | CoreError::InvalidCallOrder(_) => {
            PyRuntimeError::new_err(err.to_string())
        }
        _ => PyValueError::new_err(err.to_string()),
    }
}

fn invalid(field: &str, msg: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("{field}: {msg}"))
}

fn non_negative(field: &str, v: i64) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| invalid(field, format!("must be >= 0, got {v}")))
}

/// A request id: any Python int in [0, 2**64); anything else is a ValueError.
struct ReqId(u64);

impl<'a, 'py> FromPyObject<'a, 'py> for ReqId {
    type Error = PyErr;

    fn extract(ob: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        ob.extract::<u64>().map(ReqId).map_err(|_| {
            let shown = ob.repr().map(|r| r.to_string()).unwrap_or_default();
            invalid(
                "req_id",
                format!("must be an int in [0, 2**64), got {shown}"),
            )
        })
    }
}

fn token_id(field: &str, t: i64) -> PyResult<u32> {
    u32::try_from(t).map_err(|_| invalid(field, format!("token id {t} out of range [0, 2**32)")))
}

/// A proposal's arrays as the core takes them: request ids, offsets, token ids (checked).
fn proposal_args(
    req_ids: &PyArrayLike1<'_, u64, AllowTypeChange>,
    cu_num_draft: &PyArrayLike1<'_, i32, AllowTypeChange>,
    draft_token_ids: &PyArrayLike1<'_, i64, AllowTypeChange>,
) -> PyResult<(Vec<u64>, Vec<i32>, Vec<u32>)> {
    Ok((
        req_ids.as_array().to_vec(),
        cu_num_draft.as_array().to_vec(),
        token_ids("draft_token_ids", draft_token_ids)?,
    ))
}

fn token_ids(field: &str, arr: &PyArrayLike1<'_, i64, AllowTypeChange>) -> PyResult<Vec<u32>> {
    arr.as_array().iter().map(|&t| token_id(field, t)).collect()
}

/// (cu_num_draft int32[R + 1], draft_token_ids int64[N]).
type Proposals<'py> = (Bound<'py, PyArray1<i32>>, Bound<'py, PyArray1<i64>>);
type SuffixProposals<'py> = (
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<f64>>,
    Bound<'py, PyArray1<bool>>,
);

/// Block-table buffers given back by numpy arrays that died, for the next steps.
type BufferPool = Arc<Mutex<Vec<Vec<i32>>>>;
const MAX_SPARE_BUFFERS: usize = 4;

/// Owner of a block-table buffer behind a numpy array (the array's `base`). When
/// the array dies the buffer goes back to its scheduler's pool instead of to the
/// allocator: the block table (S x W int32, the largest array of a step) is then
/// written into warm memory, without fresh pages to fault in every step.
#[pyclass(module = "specinfer._core", frozen)]
struct RecycledBuffer {
    data: Vec<i32>,
    pool: BufferPool,
}

impl Drop for RecycledBuffer {
    fn drop(&mut self) {
        let data = std::mem::take(&mut self.data);
        if let Ok(mut pool) = self.pool.lock() {
            if pool.len() < MAX_SPARE_BUFFERS {
                pool.push(data);
            }
        }
    }
}

/// A 2-D numpy view of `data` (row-major `shape`) whose base owns `data`: no copy.
fn recycled_array2<'py>(
    py: Python<'py>,
    data: Vec<i32>,
    shape: [usize; 2],
    pool: &BufferPool,
) -> PyResult<Bound<'py, PyArray2<i32>>> {
    debug_assert_eq!(data.len(), shape[0] * shape[1]);
    let owner = Bound::new(
        py,
        RecycledBuffer {
            data,
            pool: pool.clone(),
        },
    )?;
    let ptr = owner.get().data.as_ptr();
    // SAFETY: the view covers exactly `data` (len == rows * cols, checked by the
    // packer); `data` lives inside `owner` (frozen, never mutated) until the array,
    // which keeps `owner` as its base, is gone.
    let view = unsafe { ArrayView2::from_shape_ptr(shape, ptr) };
    Ok(unsafe { PyArray2::borrow_from_array(&view, owner.into_any()) })
}

/// The core scheduler: requests, KV blocks, one `schedule()` + `update()` per step.
#[pyclass(module = "specinfer._core")]
struct SchedulerCore {
    inner: Scheduler,
    spare_block_tables: BufferPool,
    /// Static-shape platforms: every scheduled batch's token axis is padded to a bucket.
    token_padding: Option<core::TokenPadding>,
}

#[pymethods]
impl SchedulerCore {
    #[new]
    #[pyo3(signature = (num_blocks, block_size, max_num_seqs, max_num_batched_tokens, max_model_len,
                        enable_prefix_caching = true, num_lookahead_tokens = 0, batch_expansion = false,
                        sliding_window = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_blocks: i64,
        block_size: i64,
        max_num_seqs: i64,
        max_num_batched_tokens: i64,
        max_model_len: i64,
        enable_prefix_caching: bool,
        num_lookahead_tokens: i64,
        batch_expansion: bool,
        sliding_window: Option<i64>,
    ) -> PyResult<Self> {
        let config = SchedulerConfig {
            num_blocks: non_negative("num_blocks", num_blocks)?,
            block_size: non_negative("block_size", block_size)?,
            max_num_seqs: non_negative("max_num_seqs", max_num_seqs)?,
            max_num_batched_tokens: non_negative("max_num_batched_tokens", max_num_batched_tokens)?,
            max_model_len: non_negative("max_model_len", max_model_len)?,
            enable_prefix_caching,
            num_lookahead_tokens: non_negative("num_lookahead_tokens", num_lookahead_tokens)?,
            batch_expansion,
            sliding_window: sliding_window
                .map(|w| non_negative("sliding_window", w))
                .transpose()?,
        };
        Ok(SchedulerCore {
            inner: Scheduler::new(config).map_err(to_py)?,
            spare_block_tables: BufferPool::default(),
            token_padding: None,
        })
    }

    #[pyo3(signature = (req_id, prompt_token_ids, max_tokens, min_tokens = 0, eos_token_id = -1,
                        ignore_eos = false, stop_token_ids = Vec::new()))]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &mut self,
        req_id: ReqId,
        prompt_token_ids: PyArrayLike1<'_, i64, AllowTypeChange>,
        max_tokens: i64,
        min_tokens: i64,
        eos_token_id: i64,
        ignore_eos: bool,
        stop_token_ids: Vec<i64>,
    ) -> PyResult<()> {
        let req_id = req_id.0;
        let prompt = token_ids("prompt_token_ids", &prompt_token_ids)?;
        let max_tokens = u32::try_from(max_tokens)
            .map_err(|_| invalid("max_tokens", format!("must be >= 1, got {max_tokens}")))?;
        let min_tokens = u32::try_from(min_tokens)
            .map_err(|_| invalid("min_tokens", format!("must be >= 0, got {min_tokens}")))?;
        let eos_token_id = match eos_token_id {
            -1 => None,
            t => Some(token_id("eos_token_id", t)?),
        };
        let stop_token_ids = stop_token_ids
            .into_iter()
            .map(|t| token_id("stop_token_ids", t))
            .collect::<PyResult<_>>()?;
        let stop = StopParams {
            max_tokens,
            min_tokens,
            eos_token_id,
            ignore_eos,
            stop_token_ids,
        };
        self.inner.add_request(req_id, prompt, stop).map_err(to_py)
    }

    fn abort_request(&mut self, req_id: ReqId) -> bool {
        let req_id = req_id.0;
        self.inner.abort_request(req_id)
    }

    fn finish_request(&mut self, req_id: ReqId) -> bool {
        let req_id = req_id.0;
        self.inner.finish_request(req_id)
    }

    fn has_unfinished_requests(&self) -> bool {
        self.inner.has_unfinished_requests()
    }

    fn num_waiting(&self) -> usize {
        self.inner.num_waiting()
    }

    fn num_running(&self) -> usize {
        self.inner.num_running()
    }

    fn get_token_ids<'py>(
        &self,
        py: Python<'py>,
        req_id: ReqId,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let req_id = req_id.0;
        let req = self
            .inner
            .request(req_id)
            .ok_or_else(|| to_py(CoreError::UnknownRequest(req_id)))?;
        let ids: Vec<i64> = req.token_ids.iter().map(|&t| t as i64).collect();
        Ok(ids.into_pyarray(py))
    }

    fn num_output_tokens(&self, req_id: ReqId) -> PyResult<usize> {
        let req_id = req_id.0;
        let req = self
            .inner
            .request(req_id)
            .ok_or_else(|| to_py(CoreError::UnknownRequest(req_id)))?;
        Ok(req.num_output_tokens())
    }

    /// Stores proposals for the next step. `draft_parents` int32[sum] (parent index
    /// within the proposal, -1 = the root) makes them token trees; None: chains.
    #[pyo3(signature = (req_ids, cu_num_draft, draft_token_ids, draft_parents = None))]
    fn set_draft_tokens(
        &mut self,
        py: Python<'_>,
        req_ids: PyArrayLike1<'_, u64, AllowTypeChange>,
        cu_num_draft: PyArrayLike1<'_, i32, AllowTypeChange>,
        draft_token_ids: PyArrayLike1<'_, i64, AllowTypeChange>,
        draft_parents: Option<PyArrayLike1<'_, i64, AllowTypeChange>>,
    ) -> PyResult<()> {
        let (ids, cu, drafts) = proposal_args(&req_ids, &cu_num_draft, &draft_token_ids)?;
        let parents = match draft_parents {
            None => None,
            Some(p) => Some(
                p.as_array()
                    .iter()
                    .map(|&x| {
                        i32::try_from(x).map_err(|_| {
                            invalid("draft_parents", format!("parent {x} out of range"))
                        })
                    })
                    .collect::<PyResult<Vec<i32>>>()?,
            ),
        };
        let inner = &mut self.inner;
        py.detach(|| inner.set_draft_tokens(&ids, &cu, &drafts, parents.as_deref()))
            .map_err(to_py)
    }

    /// The tokens of stored proposals (placeholders set while they were drafted on the device),
    /// allowed while the step verifying them is pending (Scheduler::replace_draft_tokens).
    fn replace_draft_tokens(
        &mut self,
        py: Python<'_>,
        req_ids: PyArrayLike1<'_, u64, AllowTypeChange>,
        cu_num_draft: PyArrayLike1<'_, i32, AllowTypeChange>,
        draft_token_ids: PyArrayLike1<'_, i64, AllowTypeChange>,
    ) -> PyResult<()> {
        let (ids, cu, drafts) = proposal_args(&req_ids, &cu_num_draft, &draft_token_ids)?;
        let inner = &mut self.inner;
        py.detach(|| inner.replace_draft_tokens(&ids, &cu, &drafts))
            .map_err(to_py)
    }

    fn propose_ngram<'py>(
        &mut self,
        py: Python<'py>,
        req_ids: PyArrayLike1<'py, u64, AllowTypeChange>,
        k: i64,
        min_n: i64,
        max_n: i64,
    ) -> PyResult<Proposals<'py>> {
        let ids = req_ids.as_array().to_vec();
        let (k, min_n, max_n) = ngram_sizes(k, min_n, max_n)?;
        let inner = &mut self.inner;
        let (cu, drafts) = py
            .detach(|| {
                inner
                    .propose_ngram(&ids, k, min_n, max_n)
                    .map(|(cu, d)| (cu, d.into_iter().map(|t| t as i64).collect::<Vec<i64>>()))
            })
            .map_err(to_py)?;
        Ok((cu.into_pyarray(py), drafts.into_pyarray(py)))
    }

    /// `propose_ngram` then `set_draft_tokens` in one call (the engine's n-gram step): drafts for
    /// the given requests that are running, ready to decode and hold no proposal, at most k each
    /// (and at most `budgets[i]` for request i where given: a speculation policy's choice).
    /// -> draft tokens set.
    #[pyo3(signature = (req_ids, k, min_n, max_n, budgets = None))]
    fn propose_ngram_drafts(
        &mut self,
        py: Python<'_>,
        req_ids: PyArrayLike1<'_, u64, AllowTypeChange>,
        k: i64,
        min_n: i64,
        max_n: i64,
        budgets: Option<PyArrayLike1<'_, i64, AllowTypeChange>>,
    ) -> PyResult<usize> {
        let ids = req_ids.as_array().to_vec();
        let (k, min_n, max_n) = ngram_sizes(k, min_n, max_n)?;
        let inner = &mut self.inner;
        match budgets {
            None => py
                .detach(|| inner.propose_ngram_drafts(&ids, k, min_n, max_n))
                .map_err(to_py),
            Some(b) => {
                let caps = b
                    .as_array()
                    .iter()
                    .map(|&x| non_negative("budgets", x).map(|x| x.min(k) as u32))
                    .collect::<PyResult<Vec<u32>>>()?;
                py.detach(|| inner.propose_ngram_drafts_budgeted(&ids, &caps, min_n, max_n))
                    .map_err(to_py)
            }
        }
    }

    /// Turns on suffix decoding (per-request tries and a global one over the outputs of the
    /// last `max_cached_requests` ended requests; 0 = per-request only).
    fn enable_suffix(&mut self, max_depth: i64, max_cached_requests: i64) -> PyResult<()> {
        let d = non_negative("max_depth", max_depth)?;
        let c = non_negative("max_cached_requests", max_cached_requests)?;
        self.inner.enable_suffix(d, c).map_err(to_py)
    }

    /// Suffix-decoding speculation trees: (cu_num_draft int32[R + 1], draft token ids int64,
    /// draft parents int32 (-1 = root), match length int64[R], score float64[R], from the
    /// global trie bool[R]).
    fn propose_suffix<'py>(
        &mut self,
        py: Python<'py>,
        req_ids: PyArrayLike1<'py, u64, AllowTypeChange>,
        budgets: PyArrayLike1<'py, i64, AllowTypeChange>,
        max_spec_factor: f64,
        min_token_prob: f64,
    ) -> PyResult<SuffixProposals<'py>> {
        let ids = req_ids.as_array().to_vec();
        let budgets = budgets
            .as_array()
            .iter()
            .map(|&b| non_negative("budgets", b))
            .collect::<PyResult<Vec<usize>>>()?;
        let inner = &mut self.inner;
        let props = py
            .detach(|| inner.propose_suffix(&ids, &budgets, max_spec_factor, min_token_prob))
            .map_err(to_py)?;
        let mut cu = Vec::with_capacity(props.len() + 1);
        cu.push(0i32);
        let (mut toks, mut parents) = (Vec::new(), Vec::new());
        let (mut lens, mut scores, mut global) = (Vec::new(), Vec::new(), Vec::new());
        for p in &props {
            toks.extend(p.tokens.iter().map(|&t| t as i64));
            parents.extend_from_slice(&p.parents);
            cu.push(toks.len() as i32);
            lens.push(p.match_len as i64);
            scores.push(p.score);
            global.push(p.global);
        }
        Ok((
            cu.into_pyarray(py),
            toks.into_pyarray(py),
            parents.into_pyarray(py),
            lens.into_pyarray(py),
            scores.into_pyarray(py),
            global.into_pyarray(py),
        ))
    }

    fn schedule(&mut self, py: Python<'_>) -> PyResult<SchedulerOutput> {
        let out = self.schedule_with(py, |core, buf| core.schedule_reusing(buf).map(Some))?;
        Ok(out.expect("schedule() always gives a batch"))
    }

    /// Schedules the next step while the pending one is on the device (plain steps only;
    /// rust/scheduler/src/lookahead.rs): None when it cannot be (then schedule() after
    /// update()). Its `input_ids` hold -1 at `ahead_input_pos`, to be filled on the device
    /// with the pending step's emitted tokens `ahead_src`.
    fn schedule_ahead(&mut self, py: Python<'_>) -> PyResult<Option<SchedulerOutput>> {
        self.schedule_with(py, |core, buf| core.schedule_ahead(buf))
    }

    /// Undoes the step scheduled ahead (the pending one stays); False when there was none.
    fn cancel_ahead(&mut self) -> bool {
        self.inner.cancel_ahead()
    }

    fn has_ahead_step(&self) -> bool {
        self.inner.has_ahead_step()
    }

    /// Pad every scheduled batch's token axis up to the smallest of `token_buckets` (static-shape
    /// platforms). Padded tokens belong to no sequence and write their K/V only into
    /// `null_block`, a block id outside the pool (>= num_blocks). `None` turns padding off.
    #[pyo3(signature = (token_buckets, null_block = 0))]
    fn set_token_padding(
        &mut self,
        token_buckets: Option<Vec<i64>>,
        null_block: i64,
    ) -> PyResult<()> {
        self.token_padding = match token_buckets {
            None => None,
            Some(b) => {
                let buckets = b
                    .into_iter()
                    .map(|x| non_negative("token_buckets", x))
                    .collect::<PyResult<Vec<usize>>>()?;
                let null =
                    u32::try_from(null_block).map_err(|_| invalid("null_block", "out of range"))?;
                Some(
                    core::TokenPadding::new(buckets, null, self.inner.num_total_blocks())
                        .map_err(to_py)?,
                )
            }
        };
        Ok(())
    }

    fn update(
        &mut self,
        py: Python<'_>,
        sampled_token_ids: PyArrayLike1<'_, i64, AllowTypeChange>,
        cu_num_sampled: PyArrayLike1<'_, i32, AllowTypeChange>,
    ) -> PyResult<UpdateOutput> {
        let tokens = token_ids("sampled_token_ids", &sampled_token_ids)?;
        let cu = cu_num_sampled.as_array().to_vec();
        let inner = &mut self.inner;
        let out = py.detach(|| inner.update(&tokens, &cu)).map_err(to_py)?;
        Ok(UpdateOutput::new(py, out))
    }

    /// Undoes the pending step as if schedule() had not run (a failure between
    /// schedule() and update()), and a step scheduled ahead of it first; False when no
    /// step was pending.
    fn cancel_step(&mut self) -> bool {
        self.inner.cancel_step()
    }

    fn num_free_blocks(&self) -> usize {
        self.inner.num_free_blocks()
    }

    fn num_total_blocks(&self) -> usize {
        self.inner.num_total_blocks()
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.config().block_size
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("num_preemptions", s.num_preemptions)?;
        d.set_item("prefix_cache_queries", s.prefix_cache_queries)?;
        d.set_item("prefix_cache_hits", s.prefix_cache_hits)?;
        d.set_item("num_steps", s.num_steps)?;
        d.set_item("num_window_freed_blocks", s.num_window_freed_blocks)?;
        if let Some(sc) = self.inner.suffix_cache() {
            d.set_item("suffix_nodes", sc.num_nodes())?;
            d.set_item("suffix_bytes", sc.bytes())?;
            d.set_item("suffix_cached_requests", sc.num_cached_requests())?;
        }
        Ok(d)
    }

    fn check_invariants(&self) -> PyResult<()> {
        self.inner.check_invariants().map_err(to_py)
    }
}

/// One step's batch (see docs/core_api.md for shapes). Arrays own the core's buffers.
impl SchedulerCore {
    /// One scheduling call (`schedule` or `schedule_ahead`) with a recycled block-table buffer,
    /// outside the GIL, its batch padded to a token bucket where padding is on.
    fn schedule_with(
        &mut self,
        py: Python<'_>,
        f: impl FnOnce(&mut core::Scheduler, Vec<i32>) -> core::Result<Option<core::SchedulerOutput>>
            + Send,
    ) -> PyResult<Option<SchedulerOutput>> {
        let buf = self
            .spare_block_tables
            .lock()
            .ok()
            .and_then(|mut p| p.pop())
            .unwrap_or_default();
        let inner = &mut self.inner;
        let padding = self.token_padding.as_ref();
        let out = py
            .detach(|| {
                let mut out = f(inner, buf)?;
                if let (Some(p), Some(o)) = (padding, out.as_mut()) {
                    p.pad(o, inner.config().block_size);
                }
                Ok(out)
            })
            .map_err(to_py)?;
        out.map(|o| SchedulerOutput::new(py, o, &self.spare_block_tables))
            .transpose()
    }
}

#[pyclass(module = "specinfer._core", frozen, get_all)]
struct SchedulerOutput {
    req_ids: Py<PyArray1<u64>>,
    num_scheduled_tokens: Py<PyArray1<i32>>,
    num_computed_tokens: Py<PyArray1<i32>>,
    num_draft_tokens: Py<PyArray1<i32>>,
    draft_token_ids: Py<PyArray1<i64>>,
    /// int32[sum num_draft_tokens]: parent of each verified draft (-1 = root; chains -1, 0, 1, ...)
    draft_parents: Py<PyArray1<i32>>,
    cu_num_logits: Py<PyArray1<i32>>,
    logits_indices: Py<PyArray1<i64>>,
    input_ids: Py<PyArray1<i64>>,
    positions: Py<PyArray1<i64>>,
    slot_mapping: Py<PyArray1<i64>>,
    query_start_loc: Py<PyArray1<i32>>,
    seq_lens: Py<PyArray1<i32>>,
    /// int64[T] tree tokens' visible nodes (bit j = node j; 0: causal); empty without tree runs
    tree_mask: Py<PyArray1<i64>>,
    /// int32[S] KV position of each sequence's tree root (else seq_len - query_len); empty without tree runs
    tree_start: Py<PyArray1<i32>>,
    block_table: Py<PyArray2<i32>>,
    seq_req_indices: Py<PyArray1<i32>>,
    preempted_req_ids: Py<PyArray1<u64>>,
    num_cached_tokens: Py<PyArray1<i32>>,
    /// int64[A] (a step scheduled ahead) input_ids entries the pending step's tokens fill
    ahead_input_pos: Py<PyArray1<i64>>,
    /// int64[A] for each, the index of its token in the pending step's emitted tokens
    ahead_src: Py<PyArray1<i64>>,
    num_prefill_tokens: usize,
    num_prefill_requests: usize,
    num_verify_requests: usize,
    total_num_scheduled_tokens: usize,
    max_query_len: usize,
    max_seq_len: usize,
    num_reqs: usize,
}

impl SchedulerOutput {
    fn new(py: Python<'_>, o: core::SchedulerOutput, pool: &BufferPool) -> PyResult<Self> {
        let shape = [o.seq_lens.len(), o.block_table_width];
        Ok(SchedulerOutput {
            num_reqs: o.req_ids.len(),
            req_ids: o.req_ids.into_pyarray(py).unbind(),
            num_scheduled_tokens: o.num_scheduled_tokens.into_pyarray(py).unbind(),
            num_computed_tokens: o.num_computed_tokens.into_pyarray(py).unbind(),
            num_draft_tokens: o.num_draft_tokens.into_pyarray(py).unbind(),
            draft_token_ids: o.draft_token_ids.into_pyarray(py).unbind(),
            draft_parents: o.draft_parents.into_pyarray(py).unbind(),
            cu_num_logits: o.cu_num_logits.into_pyarray(py).unbind(),
            logits_indices: o.logits_indices.into_pyarray(py).unbind(),
            input_ids: o.input_ids.into_pyarray(py).unbind(),
            positions: o.positions.into_pyarray(py).unbind(),
            slot_mapping: o.slot_mapping.into_pyarray(py).unbind(),
            query_start_loc: o.query_start_loc.into_pyarray(py).unbind(),
            seq_lens: o.seq_lens.into_pyarray(py).unbind(),
            tree_mask: o.tree_mask.into_pyarray(py).unbind(),
            tree_start: o.tree_start.into_pyarray(py).unbind(),
            block_table: recycled_array2(py, o.block_table, shape, pool)?.unbind(),
            seq_req_indices: o.seq_req_indices.into_pyarray(py).unbind(),
            preempted_req_ids: o.preempted_req_ids.into_pyarray(py).unbind(),
            num_cached_tokens: o.num_cached_tokens.into_pyarray(py).unbind(),
            ahead_input_pos: o.ahead_input_pos.into_pyarray(py).unbind(),
            ahead_src: o.ahead_src.into_pyarray(py).unbind(),
            num_prefill_tokens: o.num_prefill_tokens,
            num_prefill_requests: o.num_prefill_requests,
            num_verify_requests: o.num_verify_requests,
            total_num_scheduled_tokens: o.total_num_scheduled_tokens,
            max_query_len: o.max_query_len,
            max_seq_len: o.max_seq_len,
        })
    }
}

#[pymethods]
impl SchedulerOutput {
    fn __len__(&self) -> usize {
        self.num_reqs
    }

    fn __repr__(&self) -> String {
        format!(
            "SchedulerOutput(num_reqs={}, total_num_scheduled_tokens={}, num_prefill_tokens={}, num_verify_requests={})",
            self.num_reqs, self.total_num_scheduled_tokens, self.num_prefill_tokens, self.num_verify_requests
        )
    }
}

/// Tokens appended by one `update()`.
#[pyclass(module = "specinfer._core", frozen, get_all)]
struct UpdateOutput {
    req_ids: Py<PyArray1<u64>>,
    cu_num_new: Py<PyArray1<i32>>,
    new_token_ids: Py<PyArray1<i64>>,
    finished_req_ids: Py<PyArray1<u64>>,
    finish_reasons: Vec<&'static str>,
    stop_token: Py<PyArray1<i64>>,
    /// int64[C] KV copies compacting verified trees' accepted paths (flat slots); apply
    /// `cache[dst] = cache[src]` in order to every KV cache before the next forward.
    kv_copy_src: Py<PyArray1<i64>>,
    kv_copy_dst: Py<PyArray1<i64>>,
}

impl UpdateOutput {
    fn new(py: Python<'_>, o: core::UpdateOutput) -> Self {
        UpdateOutput {
            req_ids: o.req_ids.into_pyarray(py).unbind(),
            cu_num_new: o.cu_num_new.into_pyarray(py).unbind(),
            new_token_ids: o.new_token_ids.into_pyarray(py).unbind(),
            finished_req_ids: o.finished_req_ids.into_pyarray(py).unbind(),
            finish_reasons: o.finish_reasons.iter().map(|r| r.as_str()).collect(),
            stop_token: o.stop_token.into_pyarray(py).unbind(),
            kv_copy_src: o.kv_copy_src.into_pyarray(py).unbind(),
            kv_copy_dst: o.kv_copy_dst.into_pyarray(py).unbind(),
        }
    }
}

#[pymethods]
impl UpdateOutput {
    fn __repr__(&self) -> String {
        format!("UpdateOutput(finish_reasons={:?})", self.finish_reasons)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<SchedulerCore>()?;
    m.add_class::<SchedulerOutput>()?;
    m.add_class::<UpdateOutput>()
}

/// The n-gram calls' sizes (k, min_n, max_n) as counts.
fn ngram_sizes(k: i64, min_n: i64, max_n: i64) -> PyResult<(usize, usize, usize)> {
    Ok((
        non_negative("k", k)?,
        non_negative("min_n", min_n)?,
        non_negative("max_n", max_n)?,
    ))
}
