"""The clients of the load benchmark: N concurrent streaming chat clients (the `openai` package's
AsyncOpenAI, as users run it), each sending its requests back to back, and what they measure.

Per request, on the client's clock: time to first token (TTFT: request sent -> first chunk with
text), time per output token (TPOT: (last chunk - first text chunk) / (completion tokens - 1)),
end-to-end latency, and the outcome: "ok" (finish_reason and usage seen), "refused" (an HTTP
status, e.g. 429), or "lost" (anything else: a cut stream, a timeout, a connection error).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class RequestResult:
    outcome: str  # "ok" | "refused" | "lost"
    status: int | None = None  # the HTTP status of a refusal
    error: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    completion_tokens: int = 0
    num_draft_tokens: int = 0  # this request's speculation counts (usage.speculative)
    num_accepted_tokens: int = 0


def _import_openai():
    try:
        import openai
    except ModuleNotFoundError:
        raise RuntimeError("the load benchmark needs the openai client: pip install openai "
                           "(it comes with specinfer[test])") from None
    return openai


async def _one_request(client, model: str, prompt: str, max_tokens: int, temperature: float,
                       ignore_eos: bool) -> RequestResult:
    openai = _import_openai()
    t0 = time.perf_counter()
    first = last = None
    finish = usage = None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=temperature, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": ignore_eos} if ignore_eos else None)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                c = chunk.choices[0]
                if c.delta is not None and c.delta.content:
                    first = first or now
                    last = now
                if c.finish_reason is not None:
                    finish = c.finish_reason
                    last = now
            if chunk.usage is not None:
                usage = chunk.usage
    except openai.APIStatusError as e:
        return RequestResult("refused", status=e.status_code, error=str(e)[:200])
    except Exception as e:  # noqa: BLE001 - every other failure is a lost request, counted, never raised
        return RequestResult("lost", error=f"{type(e).__name__}: {e}"[:200])
    end = time.perf_counter()
    if finish is None or usage is None:
        return RequestResult("lost", error="the stream ended without a finish_reason and usage")
    n = int(usage.completion_tokens)
    spec = (usage.model_extra or {}).get("speculative") or {}
    tpot = (last - first) / (n - 1) if first is not None and n > 1 else None
    return RequestResult("ok", ttft_s=(first - t0) if first is not None else None, tpot_s=tpot, e2e_s=end - t0,
                         completion_tokens=n, num_draft_tokens=int(spec.get("num_draft_tokens", 0)),
                         num_accepted_tokens=int(spec.get("num_accepted_tokens", 0)))


async def _run_level(base_url: str, model: str, prompts: list[str], concurrency: int, requests_per_client: int,
                     max_tokens: int, temperature: float, ignore_eos: bool, timeout_s: float):
    openai = _import_openai()
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=timeout_s)
    results: list[RequestResult] = []

    async def worker(c: int):
        for r in range(requests_per_client):
            prompt = prompts[(c * requests_per_client + r) % len(prompts)]
            results.append(await _one_request(client, model, prompt, max_tokens, temperature, ignore_eos))

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker(c) for c in range(concurrency)))
    finally:
        await client.close()
    return results, time.perf_counter() - t0


def run_level(base_url: str, model: str, prompts: list[str], *, concurrency: int, requests_per_client: int,
              max_tokens: int, temperature: float = 0.0, ignore_eos: bool = False,
              timeout_s: float = 600.0) -> dict:
    """Run one concurrency level; return its summary (see `summarize`) with the per-request results."""
    results, wall = asyncio.run(_run_level(base_url, model, prompts, concurrency, requests_per_client, max_tokens,
                                           temperature, ignore_eos, timeout_s))
    return summarize(results, wall, concurrency)


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    a = np.asarray(values, dtype=np.float64)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}


def summarize(results: list[RequestResult], wall_s: float, concurrency: int) -> dict:
    ok = [r for r in results if r.outcome == "ok"]
    refused: dict[str, int] = {}
    for r in results:
        if r.outcome == "refused":
            refused[str(r.status)] = refused.get(str(r.status), 0) + 1
    tokens = sum(r.completion_tokens for r in ok)
    drafts = sum(r.num_draft_tokens for r in ok)
    accepted = sum(r.num_accepted_tokens for r in ok)
    return {
        "concurrency": concurrency, "num_requests": len(results), "num_ok": len(ok), "refused": refused,
        "num_lost": sum(1 for r in results if r.outcome == "lost"),
        "lost_errors": sorted({r.error for r in results if r.outcome == "lost"})[:5],
        "wall_s": wall_s, "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "output_tokens": tokens, "output_tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "ttft_s": _percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": _percentiles([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_s": _percentiles([r.e2e_s for r in ok if r.e2e_s is not None]),
        "acceptance_rate": accepted / drafts if drafts else None,
        "requests": [asdict(r) for r in results],
    }
