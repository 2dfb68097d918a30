"""Serving under load with and without hostile clients beside it (issue 41), on 127.0.0.1 only.

`specinfer serve MODEL` runs in its own process (the load bench's ServerProcess); 64 streaming chat
clients send their requests back to back (the load bench's client), once alone and once while
hostile clients run beside them: 100 slowloris connections, oversize bodies, a client that asks
for more completions than fit, poisoned sampling parameters and streams that are never read.
Rounds alternate (clean, hostile, clean, hostile, ...). Prints requests/s, p99 end-to-end and
time-to-first-token per round, what the hostile clients got back, and checks that every
well-behaved request completed.

    python benches/serve_hostile_load.py --model smollm2-135m --clients 64 --rounds 2
"""
from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import sys
import threading
import time
from urllib.parse import urlparse

from specinfer.bench.load_client import run_level
from specinfer.bench.load_config import LoadConfig, LoadMethod
from specinfer.bench.load_runner import ServerProcess


def _post(port, body, timeout=30):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = json.dumps(body).encode()
    conn.request("POST", "/v1/completions", body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp.status


class Hostile:
    """The attackers, each in its own thread until stop()."""

    def __init__(self, port: int):
        self.port = port
        self.halt = threading.Event()
        self.seen: dict[str, dict] = {k: {} for k in ("slowloris", "oversize", "hog", "poisoned", "nonreader")}
        self.threads = [threading.Thread(target=getattr(self, k), daemon=True) for k in self.seen]

    def count(self, kind, outcome):
        self.seen[kind][outcome] = self.seen[kind].get(outcome, 0) + 1

    def start(self):
        for t in self.threads:
            t.start()

    def stop(self):
        self.halt.set()
        for t in self.threads:
            t.join(60)

    def slowloris(self):
        socks = []
        while not self.halt.is_set():
            if len(socks) < 100:
                try:
                    s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                    socks.append(s)
                    self.count("slowloris", "opened")
                except OSError:
                    self.count("slowloris", "refused")
            for s in list(socks):
                try:
                    s.sendall(b"X")
                except OSError:
                    socks.remove(s)
                    s.close()
                    self.count("slowloris", "cut by the server")
            time.sleep(0.05)
        for s in socks:
            s.close()

    def _loop(self, kind, body, pause):
        while not self.halt.is_set():
            try:
                self.count(kind, str(_post(self.port, body)))
            except OSError as e:
                self.count(kind, type(e).__name__)
            self.halt.wait(pause)

    def oversize(self):
        self._loop("oversize", {"prompt": "hello " * 1_000_000, "max_tokens": 1}, 0.2)

    def hog(self):
        self._loop("hog", {"prompt": ["hello"] * 4096, "max_tokens": 64}, 0.1)

    def poisoned(self):
        self._loop("poisoned", {"prompt": "hi", "max_tokens": 4, "temperature": 0.7, "top_p": 1e-300}, 0.1)

    def nonreader(self):
        while not self.halt.is_set():
            try:
                s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
                body = json.dumps({"prompt": "Tell me a long story.", "max_tokens": 512, "stream": True}).encode()
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                self.count("nonreader", "sent")
                self.halt.wait(5.0)  # reads nothing
                s.close()
            except OSError as e:
                self.count("nonreader", type(e).__name__)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cfg = LoadConfig(name="hostile", model=args.model, methods=(LoadMethod("plain"),), concurrency=(args.clients,),
                     requests_per_client=args.requests_per_client, max_tokens=args.max_tokens, ignore_eos=True,
                     threads=args.threads, server_args=("--max-num-seqs", str(args.clients)))
    prompts = ["Write a haiku about the sea.", "Explain what a hash map is.", "List three prime numbers.",
               "What is the capital of Italy?", "def add(a, b):", "Summarize: the cat sat on the mat."]
    server = ServerProcess(cfg, cfg.methods[0])
    rows = []
    try:
        port = urlparse(server.base_url).port
        run_level(server.base_url, "bench", prompts, concurrency=4, requests_per_client=1, max_tokens=4)  # warm
        for r in range(2 * args.rounds):
            hostile = r % 2 == 1
            attack = Hostile(port) if hostile else None
            if attack:
                attack.start()
                time.sleep(1.0)
            res = run_level(server.base_url, "bench", prompts, concurrency=args.clients,
                            requests_per_client=args.requests_per_client, max_tokens=args.max_tokens,
                            ignore_eos=True)
            if attack:
                attack.stop()
            server.wait_idle()
            rows.append({"hostile": hostile, "requests_per_s": res["requests_per_s"], "num_ok": res["num_ok"],
                         "num_requests": res["num_requests"], "p99_e2e_s": res["e2e_s"]["p99"],
                         "p99_ttft_s": res["ttft_s"]["p99"], "refused": res["refused"], "lost": res["num_lost"],
                         "attackers": attack.seen if attack else None})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        code = server.stop()
    print(f"\n{args.clients} streaming chat clients x {args.requests_per_client} requests, {args.max_tokens} tokens "
          f"each, {args.model}; median of {args.rounds} rounds each (alternating)")
    print("| clients | hostile clients beside | requests/s | p99 end-to-end s | p99 TTFT s | completed |")
    print("|---:|---|---:|---:|---:|---:|")
    for hostile in (False, True):
        rs = [x for x in rows if x["hostile"] == hostile]
        print(f"| {args.clients} | {'yes' if hostile else 'no'} | "
              f"{statistics.median(x['requests_per_s'] for x in rs):.2f} | "
              f"{statistics.median(x['p99_e2e_s'] for x in rs):.2f} | "
              f"{statistics.median(x['p99_ttft_s'] for x in rs):.2f} | "
              f"{sum(x['num_ok'] for x in rs)}/{sum(x['num_requests'] for x in rs)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    ok = all(x["num_ok"] == x["num_requests"] for x in rows) and code == 0
    print("server exit status", code, "; every well-behaved request completed" if ok else "; FAILURES")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
