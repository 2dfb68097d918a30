"""Flags shared by `generate`, `chat` and `demo`, and their translation into engine objects.

Everything here is checked before a model is loaded: a bad k, an unknown model or a missing
file costs the user a second, not a model load.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from specinfer.cli.errors import CliError

DTYPES = ["auto", "float32", "bfloat16", "float16"]


def add_model_argument(p: argparse.ArgumentParser, *, default: str | None = None) -> None:
    kw = {"nargs": "?", "default": default} if default else {}
    p.add_argument("model", metavar="MODEL", help="target model: a pack name (see `specinfer models`), an HF "
                   "directory or a .gguf file" + (f" (default: {default})" if default else ""), **kw)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per engine option, derived from EngineConfig's fields (specinfer/config.py): the
    option `max_num_seqs` is `--max-num-seqs`, a bool `--x` / `--no-x`; help and default from the field."""
    from specinfer.config import engine_options

    g = p.add_argument_group("engine (EngineConfig: the options of Generator and LLMEngine)")
    for name, (_, f) in engine_options().items():
        cli = dict(f.metadata["cli"])
        flag = "--" + name.replace("_", "-")
        names = [flag, *cli.pop("aliases", [])]
        none_as = cli.pop("none_as", None)
        default = none_as if (f.default is None and none_as is not None) else f.default
        help_text = f.metadata["help"]
        if "default" not in help_text and default is not None:
            help_text += f" (default: {'on' if default is True else 'off' if default is False else default})"
        if isinstance(f.default, bool):
            g.add_argument(*names, dest=name, action=argparse.BooleanOptionalAction, default=f.default,
                           help=help_text)
            continue
        cli.setdefault("type", type(f.default) if f.default is not None else str)
        g.add_argument(*names, dest=name, default=default, help=help_text.replace("%", "%%"), **cli)


def add_renamed_flag(group, old: str, new: str) -> None:
    """`old` is refused with the name that replaced it (never taken as an abbreviation of a longer
    flag, which argparse would otherwise do silently)."""

    class Renamed(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.error(f"{old} is now {new}")

    group.add_argument(old, action=Renamed, nargs="?", help=argparse.SUPPRESS)


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    from specinfer.spec_decode.registry import ACCEPTANCE_METHODS, POLICIES, SCORERS, proposer_names

    g = p.add_argument_group("speculative decoding (off unless --speculative-config, --method, --draft-model or -k "
                             "is given)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='the whole SpeculativeConfig as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                        "(instead of the flags below)")
    g.add_argument("--method", choices=[*proposer_names(), "none"], default=None,
                   help="proposer (default: draft_model with --draft-model, else ngram with -k, else none)")
    g.add_argument("--draft-model", dest="draft", default=None, metavar="MODEL", help="draft model for --method "
                   "draft_model (pack name, HF directory or .gguf; another tokenizer than the target's drafts "
                   "through text)")
    add_renamed_flag(g, "--draft", "--draft-model MODEL (llama.cpp's --draft is a token count: -k here)")
    g.add_argument("--head", default=None, metavar="DIR", help="draft-head checkpoint directory for --method "
                   "mlp_speculator, medusa, eagle or eagle3 (their public layouts), or a named head "
                   "(smollm2-135m-eagle, -medusa, -mlp: trained once on first use, then cached)")
    g.add_argument("--exit-layer", type=int, default=None, metavar="E",
                   help="layer_skip: draft with the target's first E layers")
    g.add_argument("-k", "--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="draft tokens per verification, 1..16 (default: 4)")
    g.add_argument("--acceptance-method", choices=sorted(ACCEPTANCE_METHODS), default="rejection_sampler",
                   help="rejection_sampler is lossless; typical_acceptance_sampler is not distribution-preserving")
    g.add_argument("--posterior-threshold", type=float, default=0.09, help="typical acceptance threshold")
    g.add_argument("--posterior-alpha", type=float, default=0.3, help="typical acceptance alpha")
    g.add_argument("--scorer", choices=sorted(SCORERS), default="mqa", help="how drafts go through the target")
    g.add_argument("--spec-policy", choices=list(POLICIES), default=None,
                   help="drafts per request and step: goodput = chosen 0..K from measured acceptance and step "
                        "cost, fixed = K every step, auto = goodput for chains (default)")
    g.add_argument("--draft-tensor-parallel-size", type=int, default=None, metavar="N",
                   help="draft_model: shard the draft over N ranks, a divisor of --tensor-parallel-size "
                        "(default: all of them)")
    g.add_argument("--draft-quantization", choices=["none", "int8"], default=None,
                   help="weights of the draft model or head: int8 = weight-only int8 GEMMs (CPU), none = dense "
                        "(default: as --quantization, but int8 for a head over a float32 target on CPU); drafts only "
                        "propose, so the output does not change")
    g.add_argument("--prompt-lookup-min", type=int, default=None, metavar="N",
                   help="ngram / --ngram-first: shortest n-gram to match (default: 1 for ngram, 2 with --ngram-first)")
    g.add_argument("--prompt-lookup-max", type=int, default=4, metavar="N", help="ngram: longest n-gram to match")
    g.add_argument("--ngram-first", action="store_true", default=None,
                   help="a head, draft model or layer_skip: requests whose history repeats their latest n-gram "
                        "draft the prompt lookup's continuation, the others the model's (the output is unchanged)")


def add_sampling_arguments(p: argparse.ArgumentParser, *, max_tokens: int = 256) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N", help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="0 = off")
    g.add_argument("--min-p", type=float, default=0.0, metavar="P")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop string (repeatable); excluded from the output")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def check_model(name: str | None, what: str = "model") -> None:
    """Fail fast on a name that is neither a pack nor an existing path (before any load)."""
    from specinfer.packs import is_pack_name
    from specinfer.training.trained_heads import TRAINED_HEADS, is_trained_head_name

    if name is None or is_pack_name(name) or is_trained_head_name(name) or Path(name).exists():
        return
    from specinfer.packs import BUILTIN_PACKS

    packs = ", ".join(p.name for p in BUILTIN_PACKS.packs)
    raise CliError(f"{what} {name!r} is neither a known pack ({packs}), a trained head ({', '.join(TRAINED_HEADS)}) "
                   f"nor an existing HF directory, head directory or .gguf file")


def speculative_config(args):
    """The SpeculativeConfig the flags ask for, or None; validated now."""
    if getattr(args, "speculative_config", None) is not None:
        return _speculative_config_json(args)
    method = args.method
    if method is None:
        method = "draft_model" if args.draft else ("ngram" if args.num_speculative_tokens is not None else "none")
    draft_tp = getattr(args, "draft_tensor_parallel_size", None)
    draft_quant = getattr(args, "draft_quantization", None)
    if method == "none":
        if args.draft:
            raise CliError("--draft-model needs speculation; drop --method none")
        if draft_quant is not None:
            raise CliError("--draft-quantization needs a draft model or head")
        if getattr(args, "ngram_first", None):
            raise CliError("--ngram-first needs a draft model, a head or layer_skip")
        if draft_tp is not None:
            raise CliError("--draft-tensor-parallel-size needs --method draft_model")
        return None
    if draft_tp is not None and method != "draft_model":
        raise CliError(f"--draft-tensor-parallel-size is only used by --method draft_model (got --method {method})")
    if args.draft and method != "draft_model":
        raise CliError(f"--draft-model is only used by --method draft_model (got --method {method})")
    if method == "draft_model" and not args.draft:
        raise CliError("--method draft_model needs --draft-model MODEL")
    check_model(args.draft, "draft model")
    from specinfer.spec_decode.config import SpeculativeConfig
    from specinfer.spec_decode.registry import MODEL_METHODS

    head = getattr(args, "head", None)
    if head is not None and (method == "draft_model" or method not in MODEL_METHODS):
        raise CliError(f"--head is only used by --method {', '.join(m for m in MODEL_METHODS if m != 'draft_model')}")
    if method in MODEL_METHODS and method != "draft_model" and head is None:
        raise CliError(f"--method {method} needs --head DIR (the head's checkpoint directory or a named head)")
    check_model(head, "--head")
    if draft_quant is not None and method not in MODEL_METHODS:
        raise CliError(f"--draft-quantization applies to a draft model or head (--method {method} has no weights)")
    k = 4 if args.num_speculative_tokens is None else args.num_speculative_tokens
    return SpeculativeConfig(
        method=method, num_speculative_tokens=k, model=head if head is not None else args.draft,
        exit_layer=getattr(args, "exit_layer", None),
        prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max,
        acceptance_method=args.acceptance_method, posterior_threshold=args.posterior_threshold,
        posterior_alpha=args.posterior_alpha, scorer=args.scorer, draft_tensor_parallel_size=draft_tp,
        policy=getattr(args, "spec_policy", None) or "auto", quantization=draft_quant,
        ngram_first=bool(getattr(args, "ngram_first", None)))


def _speculative_config_json(args):
    import json

    from specinfer.spec_decode.config import SpeculativeConfig

    clashing = [flag for flag, value in (("--method", args.method), ("--draft-model", args.draft),
                                         ("-k", args.num_speculative_tokens),
                                         ("--spec-policy", getattr(args, "spec_policy", None)),
                                         ("--draft-tensor-parallel-size",
                                          getattr(args, "draft_tensor_parallel_size", None)),
                                         ("--draft-quantization", getattr(args, "draft_quantization", None)),
                                         ("--ngram-first", getattr(args, "ngram_first", None)))
                if value is not None]
    if clashing:
        raise CliError(f"--speculative-config cannot be combined with {', '.join(clashing)}")
    try:
        value = json.loads(args.speculative_config)
    except json.JSONDecodeError as e:
        raise CliError(f"--speculative-config is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise CliError("--speculative-config must be a JSON object")
    try:
        spec = SpeculativeConfig.from_any(value)
    except (TypeError, ValueError) as e:
        raise CliError(f"--speculative-config: {' '.join(str(e).split())}") from None
    check_model(spec.model, "draft model")
    return spec


def sampling_params(args, **overrides):
    from specinfer.sampling_params import SamplingParams

    fields = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  min_p=args.min_p, stop=tuple(args.stop) if args.stop else None,
                  ignore_eos=args.ignore_eos)
    fields.update(overrides)
    return SamplingParams(**fields)


def engine_config(args, spec):
    """The EngineConfig the engine flags ask for (with `spec`), validated now: a bad value is a
    one-line CliError naming its flag, before any model loads."""
    from specinfer.config import EngineConfig, engine_options

    options = {}
    for name, (_, f) in engine_options().items():
        value = getattr(args, name)
        options[name] = None if value is not None and value == f.metadata["cli"].get("none_as") else value
    try:
        return EngineConfig.create(args.model, speculative=spec, **options)
    except ValueError as e:
        msg = str(e)
        for name in engine_options():
            if msg.startswith(name + " "):  # the option's name -> the flag the user typed
                msg = "--" + name.replace("_", "-") + msg[len(name):]
                break
        raise CliError(msg) from None


def load_generator(config):
    """Build the Generator (the slow part), after every cheap check has passed."""
    from specinfer.generator import Generator

    return Generator(config)


def format_spec_summary(metrics: dict | None) -> str:
    if not metrics or not metrics.get("num_drafts"):
        return "speculation: off" if metrics is None else "acceptance rate: - (no drafts)"
    return (f"acceptance rate: {metrics['acceptance_rate']:.3f}  "
            f"mean acceptance length: {metrics['mean_acceptance_length']:.2f}")
