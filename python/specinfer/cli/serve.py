"""`specinfer serve`: an OpenAI-compatible HTTP server over the engine (needs `specinfer[serve]`)."""
from __future__ import annotations

import sys

from specinfer.cli import options
from specinfer.cli.errors import CliError

HELP = "serve a model over an OpenAI-compatible HTTP API (completions, chat, streaming, /metrics)"
DESCRIPTION = HELP + """

Endpoints: POST /v1/completions, POST /v1/chat/completions (the model's chat template), both with
"stream": true as server-sent events; GET /v1/models, /health, /metrics (Prometheus).
Sampling fields: max_tokens, temperature, top_p, seed, stop, logprobs (chat: logprobs +
top_logprobs), and as extensions top_k, min_p, ignore_eos, min_tokens, stop_token_ids. Every final
response carries "usage", with this request's speculation counts under usage.speculative.
More than --max-num-seqs + --max-waiting-requests requests in flight: 429 (with Retry-After).
SIGINT / SIGTERM: stop accepting, let in-flight requests finish for --shutdown-timeout seconds,
abort the rest, exit 0. Reachable by others? Set --api-key (or $SPECINFER_API_KEY) and
--allowed-hosts; every client-controlled size and time has a bound below.

Examples:
  specinfer serve smollm2-135m --method ngram -k 4 --port 8000
  specinfer serve qwen2.5-coder-1.5b --speculative-config '{"method": "draft_model", "model": "qwen2.5-coder-0.5b"}'
  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"prompt": "def fib(n):", "max_tokens": 32, "temperature": 0}'
"""


def add_arguments(p) -> None:
    options.add_model_argument(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    g.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000; 0 = any free port)")
    g.add_argument("--served-model-name", metavar="NAME", default=None,
                   help="the model id in /v1/models and in requests (default: MODEL as given)")
    g.add_argument("--max-waiting-requests", type=int, default=256, metavar="N",
                   help="requests admitted beyond --max-num-seqs before new ones get 429 (default: 256)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGINT/SIGTERM, seconds in-flight requests may take to finish before they are "
                        "aborted (default: 30)")
    a = p.add_argument_group("access (a server reachable by others needs --api-key)")
    a.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: "
                        "$SPECINFER_API_KEY; none)")
    a.add_argument("--metrics-require-key", action="store_true", help="/metrics behind the API key too")
    a.add_argument("--allowed-hosts", default=None, metavar="H1,H2",
                   help="Host header values served (DNS-rebinding guard; default: localhost, 127.0.0.1 and "
                        "[::1] when bound to a loopback address, any otherwise; '*' = any)")
    a.add_argument("--allowed-origins", default=None, metavar="O1,O2",
                   help="CORS: origins whose web pages may call the API (default: none)")
    b = p.add_argument_group("limits (each bounds something a client controls)")
    b.add_argument("--max-body-bytes", type=int, default=4 * 2**20, metavar="N",
                   help="request body size; larger: 413 (default: 4 MiB)")
    b.add_argument("--max-prompt-bytes", type=int, default=None, metavar="N",
                   help="prompt text, checked before tokenizing (default: 64 x max_model_len)")
    b.add_argument("--max-prompts-per-request", type=int, default=16, metavar="N",
                   help="prompts in one completions request (default: 16)")
    b.add_argument("--max-connections", type=int, default=1024, metavar="N",
                   help="connections at once; beyond: 503 (default: 1024)")
    b.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="seconds a request head may take (slowloris) (default: 10)")
    b.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="seconds a request body may take; then 408 (default: 30)")
    b.add_argument("--write-timeout", type=float, default=60.0, metavar="S",
                   help="seconds a client may leave a response chunk untaken before the connection ends "
                        "(default: 60)")
    b.add_argument("--keep-alive-timeout", type=float, default=5.0, metavar="S",
                   help="seconds an idle keep-alive connection stays open (default: 5)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")
    options.add_speculative_arguments(p)
    options.add_engine_arguments(p)


def _check_server_args(args) -> None:
    if not 0 <= args.port <= 65535:
        raise CliError(f"--port must be in [0, 65535] (got {args.port})")
    if args.max_waiting_requests < 0:
        raise CliError(f"--max-waiting-requests must be >= 0 (got {args.max_waiting_requests})")
    if not args.shutdown_timeout >= 0:
        raise CliError(f"--shutdown-timeout must be >= 0 (got {args.shutdown_timeout})")


LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def _names(value: str | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(v.strip() for v in value.split(",") if v.strip())


def serve_config(args, name: str):
    """ServeConfig from the flags (and $SPECINFER_API_KEY)."""
    import os

    from specinfer.serve import ServeConfig

    hosts = _names(args.allowed_hosts)
    if hosts is None and args.host in LOOPBACK:
        hosts = ("localhost", "127.0.0.1", "[::1]")
    if hosts is not None and "*" in hosts:
        hosts = None
    try:
        return ServeConfig(
            name, max_requests_in_flight=args.max_num_seqs + args.max_waiting_requests,
            api_key=args.api_key or os.environ.get("SPECINFER_API_KEY") or None,
            metrics_need_key=args.metrics_require_key, allowed_hosts=hosts,
            allowed_origins=_names(args.allowed_origins) or (), max_body_bytes=args.max_body_bytes,
            max_prompt_bytes=args.max_prompt_bytes, max_prompts_per_request=args.max_prompts_per_request,
            max_connections=args.max_connections, header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout, write_timeout_s=args.write_timeout,
            keep_alive_timeout_s=args.keep_alive_timeout)
    except ValueError as e:
        raise CliError(str(e).replace("ServeConfig.", "--").replace("_", "-")) from None


def run(args) -> int:
    options.check_model(args.model)
    spec = options.speculative_config(args)
    engine_config = options.engine_config(args, spec)
    _check_server_args(args)
    try:
        from specinfer.serve import build_app, make_server
    except ModuleNotFoundError as e:
        raise CliError(f"`specinfer serve` needs the serve extra (pip install 'specinfer[serve]'): "
                       f"{e.name} is not installed") from None
    serve_config(args, args.served_model_name or args.model)  # bad limits fail before the model loads
    gen = options.load_generator(engine_config)
    name = args.served_model_name or args.model
    config = serve_config(args, name)
    app = build_app(gen.engine, config)
    server = make_server(app, host=args.host, port=args.port, graceful_timeout_s=args.shutdown_timeout,
                         log_level=args.log_level, access_log=args.access_log)
    spec_text = f"{spec.method}, k={spec.num_speculative_tokens}" if spec is not None else "off"
    print(f"specinfer serve: {name} (speculation: {spec_text}; max_model_len {gen.engine.max_model_len}, "
          f"{gen.engine.num_kv_blocks} KV blocks) on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    server.run()
    loop = app.state.serve.loop
    print(f"specinfer serve: shut down; requests finished: {loop.num_finished}, aborted at shutdown: "
          f"{loop.num_aborted_at_shutdown}", file=sys.stderr, flush=True)
    if loop.fatal is not None:
        raise RuntimeError(f"the engine loop crashed: {loop.fatal}")
    return 0 if server.started else 1
