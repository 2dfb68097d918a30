"""One frozen EngineConfig: every engine option is written once (a field of its section in
specinfer/config.py), and Generator, LLMEngine and the CLI derive from it."""
from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from specinfer import Generator
from specinfer.cli import build_parser, options as cli_options
from specinfer.cli.errors import CliError
from specinfer.config import EngineConfig, engine_options
from specinfer.engine.llm_engine import LLMEngine

# a non-default value for every option (what a CLI user would type, and what the API gets)
NON_DEFAULT = {
    "dtype": ("bfloat16", "bfloat16"), "device": ("cpu", "cpu"), "quantization": ("none", None),
    "attention_backend": ("torch_ref", "torch_ref"), "batch_invariant": (None, True), "max_logprobs": ("5", 5),
    "seed": ("7", 7), "threads": ("1", 1), "block_size": ("32", 32), "num_kv_blocks": ("64", 64),
    "enable_prefix_caching": (None, False), "gpu_memory_utilization": ("0.5", 0.5), "max_num_seqs": ("8", 8),
    "max_num_batched_tokens": ("512", 512), "max_model_len": ("128", 128), "overlap_steps": (None, False), "schedule_ahead": (None, False),
    "forward_thread": ("off", "off"),
    "tensor_parallel_size": ("2", 2), "distributed_timeout_s": ("30", 30.0),
}


def test_every_option_has_a_test_value():
    assert set(NON_DEFAULT) == set(engine_options())


def test_generator_and_engine_take_the_options_from_the_config_alone():
    """No option is written out as a keyword of Generator or LLMEngine (a new option is one field)."""
    for cls in (Generator, LLMEngine):
        params = list(inspect.signature(cls.__init__).parameters.values())
        assert [p.name for p in params] == ["self", "model", "options"]
        assert params[2].kind is inspect.Parameter.VAR_KEYWORD
        for name in engine_options():  # ... and their docstrings list every option
            assert f"`{name}`" in cls.__doc__


def test_every_option_is_a_cli_flag_that_reaches_the_config():
    args = ["generate", "m", "--prompt", "hi"]
    for name, (cli_value, _) in NON_DEFAULT.items():
        flag = "--" + name.replace("_", "-")
        default_on = engine_options()[name][1].default is True
        args += [("--no-" + flag[2:]) if default_on else flag] if cli_value is None else [flag, cli_value]
    cfg = cli_options.engine_config(build_parser().parse_args(args), None)
    assert cfg.options() == {name: value for name, (_, value) in NON_DEFAULT.items()}
    defaults = cli_options.engine_config(build_parser().parse_args(["generate", "m", "--prompt", "hi"]), None)
    assert defaults == EngineConfig.create("m")  # the CLI's defaults are the API's


def test_the_config_is_frozen_and_round_trips():
    api = {name: value for name, (_, value) in NON_DEFAULT.items()}
    cfg = EngineConfig.create("m", speculative={"method": "ngram", "num_speculative_tokens": 3}, **api)
    assert EngineConfig.create("m", speculative=cfg.speculative, **cfg.options()) == cfg
    assert (cfg.cache.block_size, cfg.scheduler.max_num_seqs, cfg.parallel.tensor_parallel_size,
            cfg.model.seed, cfg.speculative.num_speculative_tokens) == (32, 8, 2, 7, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cache.block_size = 8
    assert cfg.replace(block_size=64).cache.block_size == 64 and cfg.cache.block_size == 32
    assert cfg.replace(speculative=None).speculative is None


def test_an_unknown_option_is_named_with_the_closest_ones():
    with pytest.raises(TypeError, match=r"'max_num_seq' \(did you mean 'max_num_seqs'"):
        EngineConfig.create("m", max_num_seq=4)
    with pytest.raises(TypeError, match="unknown engine option 'bogus'"):
        Generator("m", bogus=1)


@pytest.mark.parametrize("option, value, fragment", [
    ("seed", -1, "seed must be an integer in [0, 2**64)"),
    ("threads", 0, "threads must be an integer >= 1 or None"),
    ("max_num_seqs", 0, "max_num_seqs must be an integer >= 1"),
    ("block_size", 1.5, "block_size must be an integer >= 1"),
    ("enable_prefix_caching", "yes", "enable_prefix_caching must be True or False"),
    ("distributed_timeout_s", 0, "distributed_timeout_s must be a number > 0"),
])
def test_a_bad_value_names_its_option_in_the_api_and_its_flag_in_the_cli(option, value, fragment):
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")
                       .replace("*", r"\*").replace("+", r"\+")):
        EngineConfig.create("m", **{option: value})
    if type(value) is int:  # what a flag can carry
        args = build_parser().parse_args(["generate", "m", "--prompt", "hi", "--" + option.replace("_", "-"),
                                          str(value)])
        with pytest.raises(CliError, match="--" + option.replace("_", "-") + " must be"):
            cli_options.engine_config(args, None)


def test_the_engine_is_built_from_one_config_passed_down(target):
    cfg = EngineConfig.create(str(target), max_num_seqs=4, block_size=8, seed=3,
                              speculative={"method": "ngram", "num_speculative_tokens": 2})
    with Generator(cfg) as gen:
        eng = gen.engine
        assert eng.config is cfg
        assert (eng.block_size, eng.spec, eng.cache_config, eng.parallel) == (8, cfg.speculative, cfg.cache,
                                                                               cfg.parallel)
    with pytest.raises(TypeError, match="use config.replace"):
        Generator(cfg, max_num_seqs=8)
    with pytest.raises(TypeError, match="use config.replace"):
        LLMEngine(cfg, seed=1)


def test_seed_means_the_engines_seed_in_every_command():
    """`--seed` is EngineConfig.seed wherever an engine is built (vLLM's meaning); a request's own
    seed travels in the request (SamplingParams.seed, a batch file's line, the server's body)."""
    for command in (["generate", "m", "--prompt", "hi"], ["chat", "m"], ["serve", "m"]):
        args = build_parser().parse_args([*command, "--seed", "5"])
        assert cli_options.engine_config(args, None).model.seed == 5
        assert cli_options.sampling_params(args).seed is None if hasattr(args, "max_tokens") else True
    p = argparse.ArgumentParser()
    cli_options.add_sampling_arguments(p)
    assert "--seed" not in p._option_string_actions


def test_vllm_flag_names_reach_the_same_options():
    base = ["generate", "m", "--prompt", "hi"]
    for flags, option, value in ((["-tp", "2"], "tensor_parallel_size", 2), (["--tp", "2"], "tensor_parallel_size", 2),
                                 (["--num-gpu-blocks-override", "9"], "num_kv_blocks", 9)):
        args = build_parser().parse_args([*base, *flags])
        assert cli_options.engine_config(args, None).options()[option] == value
