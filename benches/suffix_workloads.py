"""Suffix decoding on repetitive (agentic) traffic and on open-ended text: suffix vs n-gram vs no
speculation on one model, batch 1, greedy unless noted.

Workloads (prompts through the model's chat template):
- repeat: N code-editing prompts answered, then the same N again; the second round is measured
  (an agent re-running a step; suffix drafts round 1's answers from its global trie);
- edits: N + 1 turns editing one code file, each turn's prompt holding the file as the last
  answer left it (a coding session rewriting the same file); the last turn is measured;
- samples: 2N samples of one prompt at temperature 0.7, seeds 0.. (RL rollouts);
- open: 2N chat prompts, each once (no repetition: the policy must keep suffix at no loss).
Each (workload, method) runs on a fresh engine (the global trie starts empty) after a warm-up on
other prompts; tokens/s ratios against no speculation are medians over --repeats alternating runs.
Reported: speedup, mean acceptance length (tokens per verification step), drafts per step and the
suffix proposal time per request per step (core.propose_suffix, wall).

    python benches/suffix_workloads.py --model smollm2-135m --repeats 2 --num 4 --max-tokens 96
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from specinfer import Generator, SamplingParams
from specinfer.prompt_sets import prompt_encoder
from specinfer.prompt_sets import load_prompt_set

MAX_TOKENS = 160
METHODS = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": 24},
}
FILE = '''def parse_config(path):
    config = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            config[key.strip()] = value.strip()
    return config
'''
EDITS = ["Add a docstring to this function.", "Rename the variable `f` to `handle`.",
         "Make it skip lines that have no '=' sign.", "Add type hints to the function.",
         "Make keys lowercase.", "Return an empty dict when the file does not exist."]


def workloads(encode, n: int) -> dict[str, list]:
    """name -> list of rounds; a round is a list of (prompt ids, params); only the last round of
    each workload is timed (earlier rounds are the history it may draft from)."""
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    edit = load_prompt_set("code_editing").prompts
    chat = load_prompt_set("chat").prompts
    repeat = [(encode(p), greedy) for p in edit[:n]]
    samples = [(encode(chat[0]), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=s))
               for s in range(2 * n)]
    return {
        "repeat": [repeat, repeat],
        "edits": "edits",  # built turn by turn from the model's answers (run_edits)
        "samples": [samples],
        "open": [[(encode(p), greedy) for p in chat[8:8 + 2 * n]]],
    }


def run_rounds(gen: Generator, rounds) -> dict:
    for r in rounds[:-1]:
        for ids, params in r:
            gen.generate([ids], params, use_tqdm=False)
    return timed(gen, rounds[-1])


def run_edits(gen: Generator, encode, n: int) -> dict:
    text, turns = FILE, []
    edits = EDITS[:n + 1]
    for instr in edits:
        turns.append(encode(f"{instr} Reply with the whole file.\n\n```python\n{text}```"))
        if len(turns) < len(edits):  # the last turn is timed below
            out = gen.generate([turns[-1]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)[0]
            body = out.text.split("```python")[-1].split("```")[0].strip("\n")
            text = (body or text) + "\n"
    return timed(gen, [(turns[-1], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))])


class ProposeClock:
    def __init__(self):
        self.s, self.requests = 0.0, 0

    def wrap(self, gen: Generator) -> None:
        prop = gen.engine.proposer
        if prop is None or not hasattr(prop, "num_global_proposals"):
            return
        core, clock = prop.core, self

        class Timed:
            def __getattr__(self, name):
                return getattr(core, name)

            def propose_suffix(self, ids, *a):
                t = time.perf_counter()
                try:
                    return core.propose_suffix(ids, *a)
                finally:
                    clock.s += time.perf_counter() - t
                    clock.requests += len(ids)

        prop.core = Timed()


def timed(gen: Generator, batch) -> dict:
    gen.reset_metrics()
    t0 = time.perf_counter()
    tokens = 0
    for ids, params in batch:  # batch 1: one request at a time
        tokens += len(gen.generate([ids], params, use_tqdm=False)[0].token_ids)
    wall = time.perf_counter() - t0
    m = gen.spec_metrics()
    return {"tok_s": tokens / wall, "tokens": tokens, "mean_accept_len": m.get("mean_acceptance_length", 0.0),
            "drafts_per_step": m["num_draft_tokens"] / max(1, m["num_steps"]),
            "acceptance_rate": m.get("acceptance_rate", 0.0)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workloads", nargs="+", default=["repeat", "edits", "samples", "open"])
    ap.add_argument("--num", type=int, default=4, help="N: prompts per round (see above)")
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    global MAX_TOKENS
    MAX_TOKENS = args.max_tokens
    base = Generator(args.model, max_model_len=2048)
    encode = prompt_encoder(base.engine.loaded, True)
    loads = workloads(encode, args.num)
    warm = [(encode(p), SamplingParams(max_tokens=32, temperature=0.0))
            for p in load_prompt_set("qa").prompts[:2]]
    for name in args.workloads:
        results = {m: [] for m in METHODS}
        for _ in range(args.repeats):
            for method, spec in METHODS.items():
                gen = Generator(args.model, max_model_len=2048, speculative=spec)
                timed(gen, warm)
                clock = ProposeClock()
                clock.wrap(gen)
                r = run_edits(gen, encode, args.num) if loads[name] == "edits" else run_rounds(gen, loads[name])
                if clock.requests:
                    r["propose_us_per_request_step"] = 1e6 * clock.s / clock.requests
                results[method].append(r)
                gen.close()
        row = {"workload": name}
        for method in ("ngram", "suffix"):
            ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(results[method], results["none"])]
            mid = sorted(results[method], key=lambda r: r["tok_s"])[len(ratios) // 2]
            row[method] = {"speedup": round(statistics.median(ratios), 3), "ratios": [round(x, 3) for x in ratios],
                           **{k: round(v, 3) for k, v in mid.items() if k != "tokens"}}
        row["none_tok_s"] = round(statistics.median(r["tok_s"] for r in results["none"]), 2)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
