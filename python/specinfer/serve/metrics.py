"""The server's Prometheus metrics (GET /metrics), in a registry of its own (several servers can
live in one process, as in the tests).

Two sources: per-request events that the engine loop observes (histograms of time to first
token, time per output token and end-to-end latency; counters of tokens and finished requests),
and an `EngineSnapshot` of the engine's state that the loop replaces after every step (gauges of
running and waiting requests, KV blocks, cumulative speculation counts). The snapshot exists
because the engine is single-threaded: a scrape must never call into it.
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 300.0)


@dataclass(frozen=True)
class EngineSnapshot:
    num_running: int = 0  # requests the scheduler is decoding
    num_waiting: int = 0  # admitted, not yet running (the scheduler's queue + the loop's inbox)
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0  # free list, prefix-cached blocks included (they are evictable)
    num_drafts: int = 0  # cumulative speculation counts (engine.spec_metrics())
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # tokens emitted by verifications: accepted + recovered/bonus
    speculative: bool = False

    @property
    def kv_blocks_used(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_free

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return self.num_emitted_tokens / self.num_drafts if self.num_drafts else 0.0


class ServerMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.snapshot = EngineSnapshot()
        self.ttft = Histogram("specinfer_time_to_first_token_seconds", "Time from arrival to the first output "
                              "token, per request", buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("specinfer_time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per request", buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("specinfer_e2e_request_latency_seconds", "Time from arrival to the last token, per "
                             "request", buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("specinfer_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("specinfer_generation_tokens", "Output tokens generated", registry=r)
        self.requests_finished = Counter("specinfer_requests_finished", "Requests that ended, by finish reason "
                                         "(stop, length, abort, error)", ["finish_reason"], registry=r)
        self.requests_rejected = Counter("specinfer_requests_rejected", "Requests refused before admission, by "
                                         "reason (invalid, queue_full, shutting_down)", ["reason"], registry=r)
        self.step_failures = Counter("specinfer_step_failures", "Engine steps that raised (their requests "
                                     "failed, the others went on)", registry=r)
        r.register(_SnapshotCollector(self))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe_finished(self, reason: str, e2e_s: float, tpot_s: float | None) -> None:
        self.requests_finished.labels(finish_reason=reason).inc()
        if reason in ("stop", "length"):
            self.e2e.observe(e2e_s)
            if tpot_s is not None:
                self.tpot.observe(tpot_s)


class _SnapshotCollector:
    """Exports the latest EngineSnapshot at scrape time."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        s = self.metrics.snapshot

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            return c

        yield gauge("specinfer_num_requests_running", "Requests the scheduler is decoding", s.num_running)
        yield gauge("specinfer_num_requests_waiting", "Requests admitted but not yet running", s.num_waiting)
        yield gauge("specinfer_kv_blocks_total", "KV cache blocks in the pool", s.kv_blocks_total)
        yield gauge("specinfer_kv_blocks_used", "KV cache blocks held by requests", s.kv_blocks_used)
        yield gauge("specinfer_kv_cache_usage_ratio", "Fraction of KV cache blocks held by requests",
                    s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
        yield gauge("specinfer_spec_decode_enabled", "1 when the server speculates", int(s.speculative))
        yield counter("specinfer_spec_decode_num_drafts", "Verifications that carried draft tokens", s.num_drafts)
        yield counter("specinfer_spec_decode_num_draft_tokens", "Draft tokens proposed", s.num_draft_tokens)
        yield counter("specinfer_spec_decode_num_accepted_tokens", "Draft tokens accepted", s.num_accepted_tokens)
        yield gauge("specinfer_spec_decode_acceptance_rate", "Accepted / proposed draft tokens since start",
                    s.acceptance_rate)
        yield gauge("specinfer_spec_decode_mean_acceptance_length", "Tokens emitted per verification (bonus "
                    "included) since start", s.mean_acceptance_length)
