"""Suffix decoding acceptance: specinfer's Rust core (method "suffix") vs Snowflake
arctic-inference's own SuffixDecodingCache, on the same token sequences.

    python benches/suffix_vs_arctic.py --arctic-path /tmp/arctic_build

`--arctic-path` is a directory holding `arctic_inference/suffix_decoding/` (its `__init__.py`,
`cache.py` and the built nanobind module `_C.*.so`) and `arctic_inference/__init__.py`; see
docs/benchmarks.md, "Suffix decoding", for the build recipe (cmake on arctic's
csrc/suffix_decoding, nanobind from pip).

Method (a simulation of greedy verification, exact for both, on fixed sequences):
1. SmolLM2-135M ("smollm2-135m", chat template) generates the outputs of three workloads
   without speculation (greedy outputs are the same with and without it):
   a) repeat:  4 code-editing prompts answered twice, greedy; round 1 only fills the caches,
               round 2 is measured;
   b) samples: chat prompt 0 sampled 8 times at temperature 0.7, seeds 0..7 (each sample may
               draft from the earlier ones through the global cache);
   c) open:    chat prompts 8..15, greedy, each once (no repetition).
   max_tokens 96. Each workload starts with empty caches in both implementations; its requests
   run one after another (batch 1, in order).
2. For each request (prompt P, output O), both implementations replay it: the prefill emits
   O[0] (no drafts in a prefill step, as in the engine), then each verification step asks for a
   speculation tree given the history P + O[:t], accepts the longest root path of the tree that
   matches O[t:] (at each level the child whose token is the next true token), capped at
   len(O) - t - 1 drafts (the engine clamps drafts so a step never passes max_tokens), and
   advances t by accepted + 1. Mean acceptance length = tokens emitted by verification steps /
   verification steps (steps with an empty tree count, emitting 1 token); `..._drafted` divides
   by the steps that had a non-empty tree only (the engine's spec_metrics() definition).
3. Same budget for both: num_speculative_tokens (tree nodes) 24, max tree depth 24,
   max_spec_factor 1.0 (max_spec_offset 0), min_token_prob 0.1, unbounded global cache.

Ours: the real scheduler core (specinfer._core.SchedulerCore with enable_suffix(24, 10**6)),
driven as the engine drives it: add_request(P), schedule()/update() commit every emitted token
(so the per-request trie grows through update(), and the request's output joins the global
trie when it finishes at max_tokens = len(O)); propose_suffix(..., budget 24, 1.0, 0.1) is
called on the live request at each verification step.
Arctic: SuffixDecodingCache(max_tree_depth=24, max_cached_requests=-1) used as arctic's vLLM
proposer uses it: start_request(P), add_active_response(emitted tokens) after each step (the
prefill's token included), speculate(context = last 24 tokens of P + O[:t], 24, 1.0, 0.0, 0.1,
use_tree_spec=True), stop_request at the end. "arctic_path" is the same with
use_tree_spec=False (a single chain: what vLLM's "suffix" method runs, as vLLM verifies chains).

Wall times (microseconds per proposal, mean and median) time only propose_suffix / speculate,
each called from Python as its engine calls it (numpy arrays in; ours returns numpy arrays,
arctic a dataclass of lists); the cost of growing the tries (update() / add_active_response) is
not included, except that our per-request trie is built lazily from the whole prompt inside a
request's first propose_suffix (arctic builds it in start_request, untimed): that shows in our
mean, hardly in our median. `mean_match_len_drafted`: the match length of the proposals that
had a non-empty tree.

Not like-for-like by design of the two libraries (reported, not corrected):
- both pick, over every match length 1..23, the draft of the highest score (ties: the longer
  match; ours also skips lengths whose node cap cannot beat the best so far);
- arctic's global tree also holds the active request's own output as it grows (ours holds ended
  requests' outputs only; the request's own output is in its per-request trie in both);
- best-first tie-breaking among equally probable nodes differs (ours: shallower, then newer);
  arctic computes probabilities in float32, ours in float64.
- sampled workload (b): the simulation treats each sample as the sequence to match, which is
  what a deterministic (one-hot) draft gets under greedy-style exact matching; an engine run at
  temperature 0.7 accepts by rejection sampling with its own random stream.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

NUM_SPEC = 24
DEPTH = 24
FACTOR = 1.0
MIN_PROB = 0.1
MAX_TOKENS = 96
MAX_CACHED = 10**6


def import_arctic(path: str):
    p = Path(path).resolve()
    if not (p / "arctic_inference" / "suffix_decoding").is_dir():
        sys.exit(f"error: --arctic-path {p} has no arctic_inference/suffix_decoding/ directory "
                 "(build arctic-inference's suffix decoding extension there first; see this script's docstring)")
    sys.path.insert(0, str(p))
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as e:
        sys.exit(f"error: cannot import arctic_inference.suffix_decoding from {p}: {e}\n"
                 "(the nanobind module _C.*.so must sit in arctic_inference/suffix_decoding/ and be built "
                 f"for this Python, {sys.version.split()[0]})")
    import arctic_inference.suffix_decoding as mod
    print(f"arctic_inference.suffix_decoding from {Path(mod.__file__).parent}", file=sys.stderr)
    return SuffixDecodingCache


def accepted_len(tokens, parents, truth, cap: int) -> int:
    """Longest root path of the tree (tokens, parents; -1 = root) matching truth[0:], <= cap."""
    children: dict[int, dict[int, int]] = {}
    for i, (tok, par) in enumerate(zip(tokens, parents)):
        children.setdefault(int(par), {}).setdefault(int(tok), i)
    node, n = -1, 0
    while n < cap and n < len(truth):
        nxt = children.get(node, {}).get(int(truth[n]))
        if nxt is None:
            break
        node, n = nxt, n + 1
    return n


class Tally:
    def __init__(self):
        self.steps = self.drafted = self.emitted = self.draft_tokens = 0
        self.match_len = 0
        self.prop_times: list[float] = []

    def timed(self, dt: float) -> None:
        self.prop_times.append(dt)

    def step(self, num_drafts: int, acc: int, match_len: int) -> None:
        self.steps += 1
        self.match_len += match_len if num_drafts else 0
        self.drafted += num_drafts > 0
        self.draft_tokens += num_drafts
        self.emitted += acc + 1

    def row(self) -> dict:
        return {"mean_acceptance_length": round(self.emitted / max(1, self.steps), 4),
                "mean_acceptance_length_drafted":
                    round((self.emitted - (self.steps - self.drafted)) / max(1, self.drafted), 4),
                "steps": self.steps, "drafted_steps": self.drafted, "emitted_tokens": self.emitted,
                "mean_tree_nodes": round(self.draft_tokens / max(1, self.steps), 3),
                "mean_match_len_drafted": round(self.match_len / max(1, self.drafted), 2),
                "propose_us": round(1e6 * float(np.mean(self.prop_times)), 2),
                "propose_us_median": round(1e6 * float(np.median(self.prop_times)), 2)}


class Ours:
    name = "ours"

    def __init__(self):
        from specinfer._core import SchedulerCore

        self.core = SchedulerCore(8192, 16, 8, 8192, 8192, False, 0, False)
        self.core.enable_suffix(DEPTH, MAX_CACHED)
        self.next_id = 1
        self.ids = np.zeros(1, np.uint64)
        self.budgets = np.full(1, NUM_SPEC, np.int64)
        self.cu1 = np.array([0, 1], np.int32)

    def _commit(self, tok: int) -> None:
        out = self.core.schedule()
        assert list(out.req_ids) == [self.cur] and out.num_reqs == 1, "one request, one token per step"
        self.core.update(np.array([tok], np.int64), self.cu1)

    def run(self, prompt, output, tally: Tally | None) -> None:
        self.cur, self.next_id = self.next_id, self.next_id + 1
        n = len(output)
        self.core.add_request(self.cur, np.asarray(prompt, np.int64), n, 0, -1, True, [])
        out = self.core.schedule()  # the whole prompt in one prefill step
        assert int(out.num_scheduled_tokens[0]) == len(prompt)
        self.core.update(np.array([output[0]], np.int64), self.cu1)
        self.ids[0] = self.cur
        t = 1
        while t < n:
            t0 = time.perf_counter()
            cu, toks, pars, mlen, _, _ = self.core.propose_suffix(self.ids, self.budgets, FACTOR, MIN_PROB)
            dt = time.perf_counter() - t0
            acc = accepted_len(toks, pars, output[t:], n - t - 1)
            if tally is not None:
                tally.timed(dt)
                tally.step(len(toks), acc, int(mlen[0]))
            for tok in output[t:t + acc + 1]:
                self._commit(int(tok))
            t += acc + 1
        assert not self.core.has_unfinished_requests(), "the request ends at max_tokens = len(output)"


class Arctic:
    def __init__(self, cache_cls, tree: bool):
        self.cache = cache_cls(max_tree_depth=DEPTH, max_cached_requests=-1)
        self.tree = tree
        self.name = "arctic_tree" if tree else "arctic_path"
        self.next_id = 0

    def run(self, prompt, output, tally: Tally | None) -> None:
        rid, self.next_id = self.next_id, self.next_id + 1
        seq = np.asarray(list(prompt) + list(output), np.int32)
        p, n = len(prompt), len(output)
        self.cache.start_request(rid, seq[:p])
        self.cache.add_active_response(rid, seq[p:p + 1])  # the prefill's token
        t = 1
        while t < n:
            ctx = seq[max(0, p + t - DEPTH):p + t]  # contiguous int32 view: the ndarray path
            t0 = time.perf_counter()
            d = self.cache.speculate(rid, ctx, NUM_SPEC, FACTOR, 0.0, MIN_PROB, self.tree)
            dt = time.perf_counter() - t0
            acc = accepted_len(d.token_ids, d.parents, output[t:], n - t - 1)
            if tally is not None:
                tally.timed(dt)
                tally.step(len(d.token_ids), acc, d.match_len)
            self.cache.add_active_response(rid, seq[p + t:p + t + acc + 1])
            t += acc + 1
        self.cache.stop_request(rid)


def generate(gen, batch):
    """[(prompt ids, SamplingParams)] -> [(prompt ids, output ids)], one generate() call."""
    outs = gen.generate([ids for ids, _ in batch], [sp for _, sp in batch], use_tqdm=False)
    return [(list(ids), list(o.token_ids)) for (ids, _), o in zip(batch, outs)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arctic-path", required=True, help="directory holding arctic_inference/suffix_decoding")
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args(argv)
    cache_cls = import_arctic(args.arctic_path)

    from specinfer import Generator, SamplingParams
    from specinfer.prompt_sets import prompt_encoder
    from specinfer.prompt_sets import load_prompt_set

    t0 = time.perf_counter()
    gen = Generator(args.model, max_model_len=2048, seed=0)
    enc = prompt_encoder(gen.engine.loaded, True)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    edit = [enc(p) for p in load_prompt_set("code_editing").prompts[:4]]
    chat = load_prompt_set("chat").prompts
    c0 = enc(chat[0])
    # workload -> (warm-up requests that fill the caches, measured requests)
    round1 = generate(gen, [(ids, greedy) for ids in edit])
    round2 = generate(gen, [(ids, greedy) for ids in edit])
    loads = {
        "repeat": (round1, round2),
        "samples": ([], generate(gen, [(c0, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=s))
                                       for s in range(8)])),
        "open": ([], generate(gen, [(enc(p), greedy) for p in chat[8:16]])),
    }
    gen.close()
    print(f"generated in {time.perf_counter() - t0:.1f} s; repeat round 2 == round 1: "
          f"{[o for _, o in round1] == [o for _, o in round2]}", file=sys.stderr)

    for name, (warm, measured) in loads.items():
        row = {"workload": name, "requests": len(measured),
               "output_tokens": sum(len(o) for _, o in measured),
               "prompt_tokens": sum(len(p) for p, _ in measured)}
        for impl in (Ours(), Arctic(cache_cls, True), Arctic(cache_cls, False)):
            for p, o in warm:
                impl.run(p, o, None)
            tally = Tally()
            for p, o in measured:
                impl.run(p, o, tally)
            row[impl.name] = tally.row()
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
