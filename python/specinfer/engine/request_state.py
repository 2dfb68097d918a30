"""Python-side state of one request: what the user sees (text, logprobs) and its random seed."""
from __future__ import annotations

from dataclasses import dataclass, field

from specinfer.engine.detokenizer import IncrementalDetokenizer
from specinfer.outputs import RequestOutput
from specinfer.sampling_params import SamplingParams


@dataclass
class RequestState:
    request_id: str
    core_id: int  # id in the Rust core
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    seed: int  # its random streams' seed: SamplingParams.seed, or drawn from the engine's seed
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    stream: bool = False  # intermediate outputs wanted (deltas since the last output)
    whole_batch: bool = False  # its caller waits for its whole batch (the speculation policy may use it)
    # the delta since the last output, for streaming
    new_token_ids: list[int] = field(default_factory=list)
    num_text_sent: int = 0  # characters of text already handed out in outputs

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    def tokens_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def append(self, tokens: list[int], logprobs: list[dict[int, float]] | None) -> bool:
        """Append tokens the core accepted; returns True when a stop string ended the request."""
        for i, t in enumerate(tokens):
            self.output_token_ids.append(t)
            self.new_token_ids.append(t)
            if self.logprobs is not None:
                self.logprobs.append(logprobs[i] if logprobs is not None else {})
            hit = self.detokenizer.push(t)
            if hit is not None:
                self.finish("stop", hit)
                break
        return self.finished

    def finish(self, reason: str, stop_reason=None) -> None:
        self.finished = True
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def to_output(self) -> RequestOutput:
        """The cumulative output with the delta since the previous one. While running, `text` holds
        back the characters that may still start a stop string; `new_text` pieces add up to `text`."""
        text = self.detokenizer.stream_text(self.finished)
        new_text = text[self.num_text_sent:]
        self.num_text_sent = max(self.num_text_sent, len(text))
        out = RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=list(self.prompt_token_ids),
            token_ids=list(self.output_token_ids), text=text, finished=self.finished,
            finish_reason=self.finish_reason, stop_reason=self.stop_reason,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            new_token_ids=self.new_token_ids, new_text=new_text, num_drafts=self.num_drafts,
            num_draft_tokens=self.num_draft_tokens, num_accepted_tokens=self.num_accepted_tokens,
            num_cached_tokens=self.num_cached_tokens)
        self.new_token_ids = []
        return out
