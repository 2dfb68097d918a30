"""How long a Generator takes to build, and how much memory it then holds: each build in a fresh
process (clean RSS), the model files warm in the page cache (one unmeasured build first), medians
of --repeats. Optionally the speculative config of a draft model (the Qwen 1.5B + 0.5B pair).

    python benches/load_time.py smollm2-135m --repeats 3
    python benches/load_time.py qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --repeats 3

--pythonpath DIR runs the builds against another checkout's python/ (an older commit, for a
before/after in one run; its specinfer/_core must be built).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads(int(sys.argv[3]))
from specinfer import Generator
t1 = time.perf_counter()
spec = {"method": "draft_model", "model": sys.argv[2], "num_speculative_tokens": 4} if sys.argv[2] else None
g = Generator(sys.argv[1], speculative=spec)
t2 = time.perf_counter()
rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")) * 1024
print(json.dumps({"import_s": t1 - t0, "build_s": t2 - t1, "rss_gb": rss / 1e9, "kv_blocks": g.engine.num_kv_blocks}))
"""


def build_once(model: str, draft: str | None, threads: int, pythonpath: str | None) -> dict:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run([sys.executable, "-c", CHILD, model, draft or "", str(threads)], env=env, check=True,
                         capture_output=True, text=True, cwd="/")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pythonpath", default=None)
    args = ap.parse_args(argv)
    build_once(args.model, args.draft, args.threads, args.pythonpath)  # page cache, compiled caches
    rows = [build_once(args.model, args.draft, args.threads, args.pythonpath) for _ in range(args.repeats)]
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(json.dumps({"model": args.model, "draft": args.draft, "pythonpath": args.pythonpath, **med}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
