"""The HTTP endpoints: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

A handler parses and validates the body (400 naming the field), tokenizes (the chat template for
chat), checks the length against max_model_len, then hands the request to the engine loop and
answers with one JSON body or an SSE stream. It never touches the engine's state: validation and
tokenization are pure, everything else goes through the loop.
"""
from __future__ import annotations

import functools
import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specinfer.sampling_params import SamplingParams
from specinfer.serve import sse
from specinfer.serve.errors import ApiError, from_value_error, internal_error, invalid
from specinfer.serve.generation import ClientGone, Generation
from specinfer.serve.metrics import CONTENT_TYPE
from specinfer.serve.protocol import ChatCompletionRequest, CompletionRequest, check_model_name, parse_body
from specinfer.serve.responses import ChatFormat, CompletionFormat
from specinfer.serve.streaming import sse_stream

log = logging.getLogger("specinfer.serve")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def api(handler):
    """ApiError -> its OpenAI error body; a client that left -> 499 (nobody reads it)."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request, request.app.state.serve)
        except ApiError as e:
            if e.status == 400:
                request.app.state.serve.metrics.requests_rejected.labels(reason="invalid").inc()
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        except ClientGone:
            return Response(status_code=499)
        except Exception as e:
            err = internal_error(f"internal error in {request.url.path}", "internal_error", e)
            return JSONResponse(err.body(), status_code=500)

    return wrapped


def _check_prompt_size(state, texts, param: str) -> None:
    """Refuse prompt text past max_prompt_bytes before any tokenizing (a 50 MB prompt costs its
    size in bytes here, not a minute of the tokenizer and gigabytes of ids)."""
    size = sum(len(t.encode("utf-8", "surrogatepass")) if isinstance(t, str) else 0 for t in texts)
    if size > state.max_prompt_bytes:
        raise invalid(f"the prompt has {size} bytes of text; this server takes at most {state.max_prompt_bytes} "
                      f"(about 64 per token of its {state.max_model_len}-token context)", param,
                      "context_length_exceeded")


async def _checked_ids(state, prompt, params: SamplingParams, prompt_param: str, max_param: str,
                       constraint_field: str | None = None) -> list[int]:
    """Validate on the thread pool (tokenizing; compiling a schema or grammar, then cached)."""
    try:
        ids = await state.off_loop(state.engine.validate, prompt, params)
    except ValueError as e:
        renames = {"structured_outputs": constraint_field} if constraint_field else {}
        raise from_value_error(e, renames, prompt_param) from None
    limit = state.max_model_len
    if len(ids) + params.max_tokens > limit:
        raise invalid(f"this model's maximum context length is {limit} tokens; the prompt has {len(ids)} and "
                      f"{max_param}={params.max_tokens} asks for {len(ids) + params.max_tokens}", max_param,
                      "context_length_exceeded")
    return ids


def _holdback(params: SamplingParams) -> int:
    return max((len(s) for s in params.stop or ()), default=1) - 1


async def _answer(request: Request, gen: Generation, fmt, params: SamplingParams, body) -> Response:
    await gen.start(request)
    if body.stream:
        return StreamingResponse(
            sse_stream(gen, fmt, holdback=_holdback(params), include_usage_chunk=body.include_usage_chunk,
                       role_chunks=isinstance(fmt, ChatFormat)),
            media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
    return JSONResponse(fmt.response(await gen.collect(request)))


@api
async def completions(request: Request, state) -> Response:
    body = parse_body(CompletionRequest, await request.body())
    check_model_name(body.model, state.model_name)
    params = body.to_sampling_params(body.max_tokens if body.max_tokens is not None
                                     else COMPLETIONS_DEFAULT_MAX_TOKENS)
    prompts = body.prompts()
    if len(prompts) * params.n > state.config.max_prompts_per_request:
        what = f"{len(prompts)} prompts x n={params.n}" if params.n > 1 else f"{len(prompts)} prompts"
        raise invalid(f"prompt holds {what}; this server takes at most "
                      f"{state.config.max_prompts_per_request} choices in one request",
                      "n" if len(prompts) == 1 else "prompt", "too_many_prompts")
    _check_prompt_size(state, prompts, "prompt")
    one = params.sample_params(0)  # what each choice runs with, but for its seed
    field = body.structured()[1]
    ids = [await _checked_ids(state, p, one, "prompt", "max_tokens", field) for p in prompts]
    gen = Generation(state.loop, "cmpl", prompts, ids, params)
    fmt = CompletionFormat(gen.id, state.model_name, state.engine.tokenizer, body.logprobs)
    fmt.n = params.n
    return await _answer(request, gen, fmt, params, body)


@api
async def chat_completions(request: Request, state) -> Response:
    body = parse_body(ChatCompletionRequest, await request.body())
    check_model_name(body.model, state.model_name)
    messages = body.template_messages()
    _check_prompt_size(state, [m["content"] for m in messages], "messages")
    try:
        ids = await state.off_loop(state.template.encode, state.engine.tokenizer, messages)
    except ValueError as e:  # the template refused the conversation
        raise invalid(" ".join(str(e).split()), "messages") from None
    requested = body.requested_max_tokens
    max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    params = body.to_sampling_params(requested if requested is not None else max(1, state.max_model_len - len(ids)))
    if params.n > state.config.max_prompts_per_request:
        raise invalid(f"n={params.n}; this server takes at most {state.config.max_prompts_per_request} choices "
                      "in one request", "n", "too_many_prompts")
    ids = await _checked_ids(state, ids, params.sample_params(0), "messages", max_param, body.structured()[1])
    gen = Generation(state.loop, "chatcmpl", [ids], [ids], params)
    fmt = ChatFormat(gen.id, state.model_name, state.engine.tokenizer,
                     (body.top_logprobs or 0) if body.logprobs else None)
    fmt.n = params.n
    return await _answer(request, gen, fmt, params, body)


async def models(request: Request) -> Response:
    state = request.app.state.serve
    return JSONResponse({"object": "list", "data": [
        {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "specinfer",
         "max_model_len": state.max_model_len}]})


async def health(request: Request) -> Response:
    loop = request.app.state.serve.loop
    if loop.accepting:
        return JSONResponse({"status": "ok"})
    reason = ("the engine loop crashed" if loop.fatal is not None else
              "the server is shutting down" if loop.alive else "the engine loop is not running")
    err = ApiError(503, reason, None, "unavailable")
    return JSONResponse(err.body(), status_code=503, headers=err.headers)


async def metrics(request: Request) -> Response:
    return Response(request.app.state.serve.metrics.render(), media_type=CONTENT_TYPE)


ROUTES = [
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
]
