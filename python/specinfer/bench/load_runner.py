"""The serving load benchmark's runner: for each repeat and method (interleaved), start
`specinfer serve` in its own process on 127.0.0.1, run every concurrency level against it, check
after each level that the server is idle with every KV block free (read from /metrics), stop it
with SIGTERM and record its exit status. Writes results.json and returns the results dict."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from specinfer.bench.load_client import run_level
from specinfer.bench.load_config import LoadConfig, LoadMethod, load_load_config
from specinfer.bench.machine import load_average, machine_info

_PORT_LINE = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


class ServerProcess:
    """`python -m specinfer serve` for one method, on a free port of 127.0.0.1."""

    def __init__(self, cfg: LoadConfig, method: LoadMethod, served_name: str = "bench"):
        args = [sys.executable, "-m", "specinfer", "serve", cfg.model, "--host", "127.0.0.1", "--port", "0",
                "--served-model-name", served_name, "--dtype", cfg.dtype,
                "--max-waiting-requests", str(max(cfg.concurrency) * 2)]
        if cfg.threads is not None:
            args += ["--threads", str(cfg.threads)]
        if method.speculative is not None:
            args += ["--speculative-config", json.dumps(method.speculative)]
        args += list(cfg.server_args)
        env = dict(os.environ)
        if cfg.threads is not None:
            env.update(OMP_NUM_THREADS=str(cfg.threads), MKL_NUM_THREADS=str(cfg.threads))
        self.served_name = served_name
        self.log: list[str] = []
        self.port: int | None = None
        # uvicorn logs the bound address at info level (access log off)
        self.proc = subprocess.Popen(args + ["--log-level", "info"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        ready = threading.Event()

        def pump():
            for line in self.proc.stdout:
                self.log.append(line)
                m = _PORT_LINE.search(line)
                if m:
                    self.port = int(m.group(1))
                    ready.set()
            ready.set()

        self._pump = threading.Thread(target=pump, daemon=True)
        self._pump.start()
        if not ready.wait(cfg.startup_timeout_s) or self.port is None:
            self.proc.kill()
            raise RuntimeError("the server did not start:\n" + "".join(self.log[-20:]))

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            m = _SAMPLE.match(line)
            if m:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
        return out

    def wait_idle(self, timeout_s: float = 60.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            if m["specinfer_num_requests_running"] == 0 and m["specinfer_num_requests_waiting"] == 0:
                return m
            if time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def stop(self, timeout_s: float = 120.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._pump.join(10)  # it reads to EOF, then the pipe can close
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
        return code


def _prompts(cfg: LoadConfig) -> list[str]:
    if cfg.prompts is not None:
        return list(cfg.prompts)
    from specinfer.prompt_sets import load_task

    sets = [load_task(t).prompts for t in cfg.tasks]
    out = []
    for i in range(max(len(s) for s in sets)):  # round robin over the tasks
        out += [s[i] for s in sets if i < len(s)]
    return out


def run_load_benchmark(config, out_dir, *, log=print) -> dict:
    cfg = config if isinstance(config, LoadConfig) else load_load_config(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompts = _prompts(cfg)
    started = time.time()
    machine = machine_info()
    runs = []
    for rep in range(cfg.repeats):
        for method in cfg.methods:  # interleaved: every method once before the next repeat
            log(f"[load] rep {rep} {method.name}: starting the server")
            srv = ServerProcess(cfg, method)
            try:
                if cfg.warmup:
                    run_level(srv.base_url, srv.served_name, prompts[:1], concurrency=1, requests_per_client=1,
                              max_tokens=min(8, cfg.max_tokens), temperature=cfg.temperature)
                for c in cfg.concurrency:
                    before = srv.metrics()
                    load = load_average()
                    level = run_level(srv.base_url, srv.served_name, prompts, concurrency=c,
                                      requests_per_client=cfg.requests_per_client, max_tokens=cfg.max_tokens,
                                      temperature=cfg.temperature, ignore_eos=cfg.ignore_eos,
                                      timeout_s=cfg.request_timeout_s)
                    after = srv.wait_idle()
                    level.update(method=method.name, repeat=rep, load_average=load,
                                 blocks_used_after=int(after["specinfer_kv_blocks_used"]),
                                 running_after=int(after["specinfer_num_requests_running"]),
                                 waiting_after=int(after["specinfer_num_requests_waiting"]),
                                 server_draft_tokens=after["specinfer_spec_decode_num_draft_tokens_total"]
                                 - before["specinfer_spec_decode_num_draft_tokens_total"],
                                 server_accepted_tokens=after["specinfer_spec_decode_num_accepted_tokens_total"]
                                 - before["specinfer_spec_decode_num_accepted_tokens_total"])
                    runs.append(level)
                    log(f"[load] rep {rep} {method.name:12s} c={c:3d}  {level['num_ok']}/{level['num_requests']} ok "
                        f"{level['output_tokens_per_s']:8.1f} tok/s  TTFT p50 {_ms(level['ttft_s']['p50'])} ms  "
                        f"TPOT p50 {_ms(level['tpot_s']['p50'])} ms  blocks used after: {level['blocks_used_after']}")
            finally:
                code = srv.stop()
            for level in runs:
                if level["method"] == method.name and level["repeat"] == rep:
                    level["server_exit_code"] = code
    results = {"schema": "specinfer-bench-serve-load/1", "name": cfg.name,
               "machine": {**machine, "load_average_end": load_average()}, "config": cfg.to_dict(),
               "started_unix": started, "duration_s": time.time() - started,
               "rows": build_load_rows(cfg, runs), "runs": runs}
    (out / "results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    return results


def _ms(x):
    return "-" if x is None else f"{x * 1e3:.1f}"


def build_load_rows(cfg: LoadConfig, runs: list[dict]) -> list[dict]:
    """One row per method x concurrency: medians over repeats, the speculative methods' ratios
    against the baseline (paired per repeat), and the totals of what was refused or lost."""
    rows = []
    base = cfg.baseline
    for method in cfg.methods:
        for c in cfg.concurrency:
            mine = [r for r in runs if r["method"] == method.name and r["concurrency"] == c]
            if not mine:
                continue

            def med(get):
                vals = [v for v in (get(r) for r in mine) if v is not None]
                return float(np.median(vals)) if vals else None

            row = {"method": method.name, "concurrency": c, "repeats": len(mine),
                   "requests": sum(r["num_requests"] for r in mine), "ok": sum(r["num_ok"] for r in mine),
                   "refused": sum(sum(r["refused"].values()) for r in mine),
                   "lost": sum(r["num_lost"] for r in mine),
                   "leaked_blocks": max(r["blocks_used_after"] for r in mine),
                   "requests_per_s": med(lambda r: r["requests_per_s"]),
                   "output_tokens_per_s": med(lambda r: r["output_tokens_per_s"]),
                   "acceptance_rate": med(lambda r: r["acceptance_rate"])}
            for metric in ("ttft_s", "tpot_s", "e2e_s"):
                for p in ("p50", "p90", "p99"):
                    row[f"{metric}_{p}"] = med(lambda r, m=metric, q=p: r[m][q])
            if base is not None and method is not base:
                pairs = [(r, b) for r in mine for b in runs
                         if b["method"] == base.name and b["concurrency"] == c and b["repeat"] == r["repeat"]]
                ratios = [r["output_tokens_per_s"] / b["output_tokens_per_s"] for r, b in pairs
                          if r["output_tokens_per_s"] and b["output_tokens_per_s"]]
                tpot = [b["tpot_s"]["p50"] / r["tpot_s"]["p50"] for r, b in pairs
                        if r["tpot_s"]["p50"] and b["tpot_s"]["p50"]]
                row["speedup_output_tokens_per_s"] = float(np.median(ratios)) if ratios else None
                row["speedup_tpot_p50"] = float(np.median(tpot)) if tpot else None
            rows.append(row)
    return rows


def format_load_table(results: dict, markdown: bool = False) -> str:
    head = ["method", "clients", "ok/req", "refused", "lost", "leaked", "req/s", "out tok/s", "TTFT p50/p90/p99 ms",
            "TPOT p50/p90/p99 ms", "alpha", "speedup tok/s", "speedup TPOT"]
    lines = []
    for r in results["rows"]:
        def trio(m):
            return "/".join(_ms(r[f"{m}_{p}"]) for p in ("p50", "p90", "p99"))

        def num(x, fmt="{:.2f}"):
            return "-" if x is None else fmt.format(x)

        lines.append([r["method"], str(r["concurrency"]), f"{r['ok']}/{r['requests']}", str(r["refused"]),
                      str(r["lost"]), str(r["leaked_blocks"]), num(r["requests_per_s"]),
                      num(r["output_tokens_per_s"], "{:.1f}"), trio("ttft_s"), trio("tpot_s"),
                      num(r["acceptance_rate"]), num(r.get("speedup_output_tokens_per_s")),
                      num(r.get("speedup_tpot_p50"))])
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join(line) + " |" for line in lines])
    widths = [max([len(h)] + [len(line[i]) for line in lines]) for i, h in enumerate(head)]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*x) for x in lines])
