"""The request bodies of the OpenAI API that the server accepts (pydantic, strict JSON types), and
their translation into SamplingParams. Every refusal is an ApiError(400) naming the field.

Beyond OpenAI's fields, as vLLM does: `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`min_tokens`, `stop_token_ids` (pass them with the openai client's `extra_body`). Structured
outputs: OpenAI's `response_format` (`json_object`, `json_schema` with `strict`), vLLM's
`structured_outputs` object and its older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` fields; at most one of them per request. Fields the engine
does not implement (best_of, echo, suffix, tools) are refused when set to anything but their
neutral value, and unknown fields are refused (400 naming the field): never silently ignored.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from specinfer.sampling_params import SamplingParams
from specinfer.structured.params import StructuredOutputsParams
from specinfer.serve.errors import ApiError, from_value_error, invalid

MAX_TOP_LOGPROBS = 20
MAX_N = 16  # samples per prompt (n); prompts x n choices are bounded by the server's max_prompts_per_request


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """The fields completions and chat share."""
    model: str | None = None
    temperature: float | None = None  # OpenAI's default: 1.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The request's output constraint and the field that set it (None, None: unconstrained)."""
        given = [(name, getattr(self, name)) for name in ("structured_outputs", "guided_json", "guided_regex",
                                                            "guided_choice", "guided_grammar")
                 if getattr(self, name) is not None]
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind not in ("text", "json_object", "json_schema"):
                raise invalid(f"response_format.type must be text, json_object or json_schema (got {kind!r})",
                              "response_format")
            if kind != "text":
                given.insert(0, ("response_format", rf))
        if not given:
            return None, None
        if len(given) > 1:
            names = ", ".join(n for n, _ in given)
            raise invalid(f"only one output constraint per request (got {names})", given[1][0])
        name, value = given[0]
        try:
            if name == "response_format":
                if value["type"] == "json_object":
                    return StructuredOutputsParams(json_object=True), name
                spec = value.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                    raise invalid("response_format json_schema needs json_schema.schema, a JSON schema object",
                                  "response_format.json_schema")
                return StructuredOutputsParams(json=spec["schema"],
                                               disable_additional_properties=spec.get("strict") is True), name
            if name == "structured_outputs":
                return StructuredOutputsParams(**value), name
            kind = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                    "guided_grammar": "grammar"}[name]
            return StructuredOutputsParams(**{kind: value}), name
        except (TypeError, ValueError) as e:
            raise invalid(f"{name}: " + " ".join(str(e).split()), name) from None

    def _refuse_unsupported(self) -> None:
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise invalid(f"n must be in [1, {MAX_N}] (got {self.n})", "n")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed with stream: true", "stream_options")

    @property
    def include_usage_chunk(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None, renames: dict[str, str],
                        prompt_param: str) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else (tuple(self.stop) if self.stop else None)
        fields = dict(max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                      top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
                      min_p=self.min_p or 0.0, seed=self.seed, stop=stop,
                      stop_token_ids=tuple(self.stop_token_ids) if self.stop_token_ids else None,
                      ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, logprobs=logprobs,
                      presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                      repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                      logit_bias=self.logit_bias or None, n=self.n or 1)
        structured, field = self.structured()
        if structured is not None:
            fields["structured_outputs"] = structured
            renames = {**renames, "structured_outputs": field}
        try:
            return SamplingParams(**fields)
        except ValueError as e:
            raise from_value_error(e, renames, prompt_param) from None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None  # OpenAI's default for completions: 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        self._refuse_unsupported()
        if self.echo:
            raise invalid("echo is not supported", "echo", "unsupported_value")
        if self.best_of not in (None, 1):
            raise invalid(f"best_of={self.best_of} is not supported (only 1)", "best_of", "unsupported_value")
        if self.suffix:
            raise invalid("suffix is not supported", "suffix", "unsupported_value")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise invalid(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}] (got {self.logprobs})", "logprobs")
        if isinstance(self.prompt, list) and not self.prompt:
            raise invalid("prompt is empty", "prompt")

    def prompts(self) -> list[str | list[int]]:
        """One engine prompt per choice: a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        return self.sampling_params(max_tokens, self.logprobs, {}, "prompt")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        msg = {"role": self.role, "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        return msg


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # default: what the context leaves after the prompt
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None

    def check(self) -> None:
        self._refuse_unsupported()
        if not self.messages:
            raise invalid("messages is empty", "messages")
        if self.tools:
            raise invalid("tools are not supported", "tools", "unsupported_value")
        if self.tool_choice not in (None, "none", "auto"):
            raise invalid("tool_choice is not supported", "tool_choice", "unsupported_value")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise invalid(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}] (got {self.top_logprobs})",
                              "top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict]:
        return [m.as_template_message() for m in self.messages]

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_name = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        return self.sampling_params(max_tokens, logprobs, {"logprobs": "top_logprobs", "max_tokens": max_name},
                                    "messages")


def parse_body(model: type[_Body], raw: bytes) -> _Body:
    """Validate a JSON body; the first problem becomes a 400 naming its field."""
    try:
        req = model.model_validate_json(raw)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = [str(x) for x in err.get("loc", ()) if not _is_type_tag(x)]
        if err["type"] == "json_invalid":
            raise invalid(f"request body is not valid JSON: {err['msg']}", None, "invalid_json") from None
        param = ".".join(loc) or None
        where = f"{param}: " if param else "request body: "
        raise invalid(where + err["msg"], param) from None
    req.check()
    return req


def _is_type_tag(x) -> bool:
    # pydantic names the union member it tried in loc (e.g. "str", "list[int]"): not a field
    return isinstance(x, str) and ("[" in x or x in ("str", "int", "float", "bool", "TextPart"))


def check_model_name(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise ApiError(404, f"model {requested!r} does not exist; this server serves {served!r}", "model",
                       "model_not_found")
