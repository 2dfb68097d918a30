"""Python-side state of one request: what the user sees (text, logprobs) and its random seed."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

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
    num_detokenized: int = 0  # output tokens already pushed through the detokenizer
    released_by_core: bool = False  # the core finished it (EOS, stop token, length) and freed its blocks
    _prompt_distinct: np.ndarray | None = field(default=None, repr=False)
    grammar: object | None = field(default=None, repr=False)  # structured outputs: its RequestGrammar

    def prompt_distinct(self) -> np.ndarray:
        """The prompt's distinct token ids (int64, sorted), computed once (the repetition penalty)."""
        if self._prompt_distinct is None:
            self._prompt_distinct = np.unique(np.asarray(self.prompt_token_ids, dtype=np.int64))
        return self._prompt_distinct

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
        """Append tokens the core accepted and detokenize them; True when a stop string ended the
        request (the serial order: both at once)."""
        self.append_tokens(tokens, logprobs)
        return self.detokenize()

    def append_tokens(self, tokens: list[int], logprobs: list[dict[int, float]] | None) -> None:
        """The step's critical part: the token history the next step and the proposer read."""
        self.output_token_ids.extend(tokens)
        self.new_token_ids.extend(tokens)
        if self.logprobs is not None:
            self.logprobs.extend(logprobs[:len(tokens)] if logprobs is not None else [{} for _ in tokens])

    def detokenize(self) -> bool:
        """Detokenize the tokens appended since the last call (off the critical path in the
        overlapped loop). A stop string ends the request at the token that completed it: later
        tokens are dropped and the reason becomes "stop" (also over a finish the core decided at
        a later token). Returns True when a stop string matched."""
        while self.num_detokenized < len(self.output_token_ids):
            i = self.num_detokenized
            self.num_detokenized += 1
            hit = self.detokenizer.push(self.output_token_ids[i])
            if hit is not None:
                drop = len(self.output_token_ids) - (i + 1)
                if drop:
                    del self.output_token_ids[i + 1:]
                    del self.new_token_ids[len(self.new_token_ids) - drop:]
                    if self.logprobs is not None:
                        del self.logprobs[i + 1:]
                self.finish("stop", hit)
                return True
        return False

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
