"""JSON extraction under a schema (fixed keys, enums, bounded integers): constrained decoding with
speculation (n-gram, with grammar-forced tokens drafted first) against constrained decoding
without, at batch 1 and 16, and the cost of the grammar masks per step.

Each prompt asks for one record as JSON; the schema fixes the keys (so `"name":"`, `","age":`
... are forced spans) and enumerates two fields. Outputs are checked to parse and validate. Ratios
are medians over `--repeats` alternating runs of both configurations on the same engine settings.
Mask cost: the time spent building the step's masks (StepGrammar.masks) and applying them
(StepMasks.apply), over the step's wall time.

    python benches/structured_json.py --models smollm2-135m qwen2.5-coder-0.5b --repeats 3 [--compact]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specinfer import Generator, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Berlin", "Tokyo", "Lima", "Cairo", "Oslo", "Other"]},
        "role": {"enum": ["engineer", "doctor", "teacher", "artist", "student", "other"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "role", "active"],
    "additionalProperties": False,
}
PEOPLE = [
    ("Alice Martin", 34, "Paris", "engineer"), ("Bruno Silva", 51, "Lima", "doctor"),
    ("Chen Wei", 27, "Tokyo", "artist"), ("Dana Kowalski", 45, "Berlin", "teacher"),
    ("Emeka Obi", 19, "Cairo", "student"), ("Freya Lund", 62, "Oslo", "doctor"),
    ("Goro Tanaka", 38, "Tokyo", "engineer"), ("Hana Novak", 29, "Berlin", "artist"),
    ("Ines Duarte", 41, "Lima", "teacher"), ("Jonas Berg", 23, "Oslo", "student"),
    ("Karim Haddad", 57, "Cairo", "engineer"), ("Lea Dubois", 33, "Paris", "teacher"),
    ("Mateo Rojas", 48, "Lima", "artist"), ("Nora Schmidt", 36, "Berlin", "doctor"),
    ("Omar Farouk", 30, "Cairo", "artist"), ("Paula Costa", 25, "Paris", "student"),
]


def prompts() -> list[str]:
    out = []
    for i, (name, age, city, role) in enumerate(PEOPLE):
        active = "still works" if i % 2 else "retired last year"
        out.append(f"Extract a JSON record with keys name, age, city, role, active.\n"
                   f"Text: {name} is {age} years old, lives in {city}, works as a {role} and {active}.\nJSON:")
    return out


class MaskClock:
    """Wall time inside the engine's mask building and applying."""

    def __init__(self):
        from specinfer.engine import step_grammar

        self.s = 0.0
        self._mod = step_grammar
        self._masks, self._apply = step_grammar.StepGrammar.masks, step_grammar.StepMasks.apply
        clock = self

        def masks(self_, *a, **kw):
            t = time.perf_counter()
            try:
                return clock._masks(self_, *a, **kw)
            finally:
                clock.s += time.perf_counter() - t

        def apply(self_, *a, **kw):
            t = time.perf_counter()
            try:
                return clock._apply(self_, *a, **kw)
            finally:
                clock.s += time.perf_counter() - t

        step_grammar.StepGrammar.masks, step_grammar.StepMasks.apply = masks, apply


def run(gen: Generator, texts: list[str], batch: int, clock: MaskClock, compact: bool = False) -> dict:
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=compact)
    params = SamplingParams(max_tokens=96, temperature=0.0, structured_outputs=so)
    gen.reset_metrics()
    proposing = gen.engine.proposing
    forced0 = proposing.num_forced_drafts if proposing is not None else 0
    clock.s = 0.0
    tokens, outs = 0, []
    t0 = time.perf_counter()
    for i in range(0, len(texts), batch):
        outs += gen.generate(texts[i:i + batch], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    for o in outs:
        if o.finish_reason == "stop":
            json.loads(o.text)
        tokens += len(o.token_ids)
    m = gen.engine.metrics.as_dict()
    spec = gen.spec_metrics()
    return {"tok_s": tokens / wall, "wall_s": wall, "steps": m["num_steps"], "mask_frac": clock.s / wall,
            "mask_us_per_step": 1e6 * clock.s / max(1, m["num_steps"]),
            "valid": sum(o.finish_reason == "stop" for o in outs), "n": len(outs),
            "accepted_per_draft": spec.get("acceptance_rate", 0.0),
            "forced_drafts": (proposing.num_forced_drafts - forced0) if proposing is not None else 0,
            "mean_accept_len": spec.get("mean_acceptance_length", 1.0)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--compact", action="store_true", help="disable_any_whitespace: compact JSON, more forced spans")
    ap.add_argument("--batch1-prompts", type=int, default=8, help="prompts run one at a time at batch 1")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(torch.get_num_threads()))
    clock = MaskClock()
    texts = prompts()
    for model in args.models:
        plain = Generator(model, max_model_len=512)
        spec = Generator(model, max_model_len=512,
                         speculative={"method": "ngram", "num_speculative_tokens": args.k})
        for batch in args.batches:
            batch_texts = texts[:args.batch1_prompts] if batch == 1 else texts
            run(plain, texts[:batch], batch, clock, args.compact)  # warm up
            run(spec, texts[:batch], batch, clock, args.compact)
            ratios, rows = [], []
            for _ in range(args.repeats):
                a = run(plain, batch_texts, batch, clock, args.compact)
                b = run(spec, batch_texts, batch, clock, args.compact)
                ratios.append(b["tok_s"] / a["tok_s"])
                rows.append((a, b))
            a, b = rows[len(rows) // 2]
            print(json.dumps({"model": model, "batch": batch, "compact": args.compact, "speedup": round(statistics.median(ratios), 3),
                              "ratios": [round(r, 3) for r in ratios],
                              "plain": {k: round(v, 4) if isinstance(v, float) else v for k, v in a.items()},
                              "spec": {k: round(v, 4) if isinstance(v, float) else v for k, v in b.items()}}),
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
