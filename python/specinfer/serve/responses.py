"""The response bodies and stream chunks of /v1/completions and /v1/chat/completions, in OpenAI's
format, built from the engine's RequestOutputs. `usage` carries OpenAI's counts plus the extension
field `speculative` (this request's drafts, draft tokens, accepted tokens, acceptance rate and
mean acceptance length; zeros when the server does not speculate)."""
from __future__ import annotations

import math
import time

from specinfer.outputs import RequestOutput

# JSON has no -inf: what a logprob of an impossible token is sent as (as vLLM does)
MIN_LOGPROB = -9999.0


def usage(outputs: list[RequestOutput], n: int = 1) -> dict:
    """OpenAI's usage: a prompt counts once however many samples (n) it has."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs[::n])
    completion = sum(len(o.token_ids) for o in outputs)
    drafts = sum(o.num_drafts for o in outputs)
    draft_tokens = sum(o.num_draft_tokens for o in outputs)
    accepted = sum(o.num_accepted_tokens for o in outputs)
    return {
        "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outputs)},
        "speculative": {
            "num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "mean_acceptance_length": (accepted + drafts) / drafts if drafts else 0.0},
    }


def _finite(lp: float | None) -> float | None:
    if lp is None:
        return None
    return MIN_LOGPROB if math.isinf(lp) or math.isnan(lp) else float(lp)


class _Format:
    """What completions and chat share: ids, the token strings of logprobs, usage chunks."""
    object_name = chunk_object = ""

    def __init__(self, response_id: str, model: str, tokenizer, num_top_logprobs: int | None):
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.num_top = num_top_logprobs  # None: no logprobs asked for
        self.n = 1  # samples per prompt: choices come n by n (usage counts each prompt once)
        self._token_text: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _top(self, entry: dict[int, float]) -> list[tuple[int, float]]:
        return sorted(entry.items(), key=lambda kv: -kv[1])[: self.num_top or 0]

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict:
        return {**self._head(self.chunk_object), "choices": [], "usage": usage(outputs, self.n)}


class CompletionFormat(_Format):
    object_name = chunk_object = "text_completion"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._offsets: dict[int, int] = {}  # per choice: text offset of the next token (streaming)

    def logprobs(self, index: int, token_ids: list[int], entries: list[dict[int, float]] | None) -> dict | None:
        if self.num_top is None or entries is None:
            return None
        tokens, lps, tops, offsets = [], [], [], []
        offset = self._offsets.get(index, 0)
        for tid, entry in zip(token_ids, entries):
            text = self.token_text(tid)
            tokens.append(text)
            lps.append(_finite(entry.get(tid)))
            tops.append({self.token_text(t): _finite(lp) for t, lp in self._top(entry)})
            offsets.append(offset)
            offset += len(text)
        self._offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def response(self, outputs: list[RequestOutput]) -> dict:
        choices = [{"index": i, "text": o.text, "logprobs": self.logprobs(i, o.token_ids, o.logprobs),
                    "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
                   for i, o in enumerate(outputs)]
        return {**self._head("text_completion"), "choices": choices, "usage": usage(outputs, self.n)}

    def chunk(self, index: int, text: str, out: RequestOutput, usage_of: list[RequestOutput] | None) -> dict:
        """The chunk for one step's delta of choice `index`: `text` (the new text the stream may
        send), the step's new tokens' logprobs; `usage_of` on a choice's last chunk."""
        n = len(out.new_token_ids)
        entries = out.logprobs[len(out.logprobs) - n:] if out.logprobs is not None else None
        choice = {"index": index, "text": text,
                  "logprobs": self.logprobs(index, out.new_token_ids, entries),
                  "finish_reason": out.finish_reason if out.finished else None}
        if out.finished:
            choice["stop_reason"] = out.stop_reason
        body = {**self._head("text_completion"), "choices": [choice]}
        if usage_of is not None:
            body["usage"] = usage(usage_of)
        return body


class ChatFormat(_Format):
    object_name, chunk_object = "chat.completion", "chat.completion.chunk"

    def logprobs(self, token_ids: list[int], entries: list[dict[int, float]] | None) -> dict | None:
        if self.num_top is None or entries is None:
            return None

        def item(tid: int, lp: float | None) -> dict:
            text = self.token_text(tid)
            return {"token": text, "logprob": _finite(lp), "bytes": list(text.encode("utf-8"))}

        content = [{**item(tid, entry.get(tid)), "top_logprobs": [item(t, lp) for t, lp in self._top(entry)]}
                   for tid, entry in zip(token_ids, entries)]
        return {"content": content, "refusal": None}

    def response(self, outputs: list[RequestOutput]) -> dict:
        choices = [{"index": i, "message": {"role": "assistant", "content": o.text},
                    "logprobs": self.logprobs(o.token_ids, o.logprobs), "finish_reason": o.finish_reason,
                    "stop_reason": o.stop_reason}
                   for i, o in enumerate(outputs)]
        return {**self._head("chat.completion"), "choices": choices, "usage": usage(outputs, self.n)}

    def role_chunk(self, index: int) -> dict:
        return {**self._head(self.chunk_object),
                "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]}

    def chunk(self, index: int, text: str, out: RequestOutput, usage_of: list[RequestOutput] | None) -> dict:
        n = len(out.new_token_ids)
        entries = out.logprobs[len(out.logprobs) - n:] if out.logprobs is not None else None
        choice = {"index": index, "delta": {"content": text} if text or not out.finished else {},
                  "logprobs": self.logprobs(out.new_token_ids, entries),
                  "finish_reason": out.finish_reason if out.finished else None}
        if out.finished:
            choice["stop_reason"] = out.stop_reason
        body = {**self._head(self.chunk_object), "choices": [choice]}
        if usage_of is not None:
            body["usage"] = usage(usage_of)
        return body
