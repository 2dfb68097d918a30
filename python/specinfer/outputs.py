"""What the engine hands back for a request: cumulative, with the latest delta on streams."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    # detokenized output so far (stop string excluded). While the request runs, the last
    # len(longest stop string) - 1 characters are held back: they may still start a stop string
    text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    # one dict per output token: {token_id: logprob} with the chosen token and the top-N
    logprobs: list[dict[int, float]] | None = None
    new_token_ids: list[int] = field(default_factory=list)  # tokens added by the latest step
    new_text: str = ""  # text added since this request's previous output: the pieces add up to `text`
    # speculation accounting for this request
    num_drafts: int = 0  # verification steps that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # SamplingParams.n > 1 through Generator.generate: the n samples of this prompt (this output's
    # own fields are sample 0's); use `outputs`, which is [self] when n = 1
    samples: list["RequestOutput"] = field(default_factory=list, repr=False)

    @property
    def outputs(self) -> list["RequestOutput"]:
        """The prompt's samples (vLLM's `RequestOutput.outputs`): n of them, or [self]."""
        return self.samples or [self]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
