"""Every validation hole of issue 7, closed: each bad input through the API, the CLI or a model
file gives a clear error naming the field, nothing of the refused request is left behind, and
the same Generator keeps serving (a good request afterwards completes, every KV block free)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from specinfer import Generator, SamplingParams
from specinfer.loader import load_model

ROOT = Path(__file__).resolve().parents[1]
GOOD_PROMPT = [5, 6, 7]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    path, _ = tiny_dir("llama", False)
    return path


@pytest.fixture(scope="module")
def gen(tiny):
    return Generator(str(tiny), max_model_len=64, block_size=4, num_kv_blocks=32)


@pytest.fixture(scope="module")
def reference(gen):
    """Greedy tokens for GOOD_PROMPT (the answer a healthy engine gives)."""
    return gen.generate([GOOD_PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)[0].token_ids


def assert_serves(gen, reference=None):
    eng = gen.engine
    assert not eng.has_unfinished_requests() and not eng._by_name
    out = gen.generate([GOOD_PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.finished and len(out.token_ids) == 12
    if reference is not None:
        assert out.token_ids == reference
    assert eng.core.num_free_blocks() == eng.core.num_total_blocks()


# ------------------------------------------------------------------ SamplingParams
@pytest.mark.parametrize("kwargs,field", [
    ({"seed": 2**64}, "seed"),
    ({"seed": -1}, "seed"),
    ({"seed": "7"}, "seed"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ({"stop_token_ids": "t2"}, "stop_token_ids"),
    ({"stop": 5}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"speculate": 1}, "speculate"),
    ({"temperature": True}, "temperature"),
    ({"logprobs": 2.0}, "logprobs"),
    ({"top_k": 2**70}, "top_k"),  # used to overflow inside the step, wedging the engine
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        SamplingParams(**kwargs)


def test_largest_seed_and_numpy_ints_are_accepted(gen, reference):
    sp = SamplingParams(seed=np.uint64(2**64 - 1), max_tokens=np.int64(3), stop_token_ids=[np.int32(9)])
    assert type(sp.seed) is int and sp.seed == 2**64 - 1 and sp.stop_token_ids == (9,)
    assert len(gen.generate([GOOD_PROMPT], sp, use_tqdm=False)[0].token_ids) >= 1
    assert_serves(gen, reference)


def test_top_k_beyond_the_vocabulary_keeps_every_token(gen, reference):
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=5, top_k=k) for k in (0, 256, 2**31 - 1)]
    outs = gen.generate([GOOD_PROMPT] * 3, params, use_tqdm=False)
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
    assert_serves(gen, reference)


# ------------------------------------------------------------------ requests against the engine
@pytest.mark.parametrize("params,match", [
    (SamplingParams(max_tokens=4, logprobs=100000), r"logprobs=100000 exceeds the engine's max_logprobs=20"),
    (SamplingParams(max_tokens=4, logprobs=21), "max_logprobs=20"),
    (SamplingParams(max_tokens=4, stop_token_ids=[256]), r"stop_token_ids holds 256, outside the vocabulary"),
])
def test_bad_params_for_this_engine(gen, reference, params, match):
    with pytest.raises(ValueError, match=match):
        gen.generate([GOOD_PROMPT, [8, 9]], params, use_tqdm=False)
    assert_serves(gen, reference)


@pytest.mark.parametrize("ids,match", [
    ([5, 300], "prompt_token_ids token id 300 is outside the vocabulary"),
    ([5, -1], "token id -1 is outside the vocabulary"),
    ([5, 1.5], "must be integers"),
    ([5, "6"], "must be integers"),
    ([True, 5], "must be integers"),
    ([], "prompt_token_ids is empty"),
    (list(range(3, 70)), "max_model_len=64"),
    (np.zeros((2, 2), dtype=np.int64), "flat list"),
])
def test_add_request_validates_prompt_token_ids(gen, reference, ids, match):
    """engine.add_request(prompt_token_ids=...) used to skip validation (the forward then failed)."""
    eng = gen.engine
    with pytest.raises(ValueError, match=match):
        eng.add_request("bad", "some text", GREEDY, prompt_token_ids=ids)
    assert "bad" not in eng._by_name
    assert_serves(gen, reference)


def test_text_whose_tokens_fall_outside_the_model_vocabulary(tiny, tmp_path):
    """A tokenizer.json larger than the model's vocabulary: the text prompt is refused, not the step."""
    from tokenizers import Tokenizer

    d = tmp_path / "big_tokenizer"
    shutil.copytree(tiny, d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_tokens(["zz"])  # id 256 in a 256-token model
    tok.save(str(d / "tokenizer.json"))
    g = Generator(str(d), max_model_len=64, block_size=4, num_kv_blocks=32)
    with pytest.raises(ValueError, match=r"prompt \(tokenized\) token id 256 is outside the vocabulary \[0, 256\)"):
        g.generate(["t5 zz"], GREEDY, use_tqdm=False)
    assert_serves(g)


def test_bad_request_id_and_params_type(gen, reference):
    with pytest.raises(ValueError, match="request_id must be a str"):
        gen.engine.add_request(7, GOOD_PROMPT, GREEDY)
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams"):
        gen.engine.add_request("x", GOOD_PROMPT, {"max_tokens": 4})
    assert_serves(gen, reference)


def test_a_request_the_core_refuses_leaves_nothing_behind(gen, reference, monkeypatch):
    """The Python state is registered before the core learns of a request and removed when the
    core raises: no half-added request, and the name can be reused."""
    eng = gen.engine
    seen = []

    class RefusingCore:
        def __init__(self, core):
            self._core = core

        def add_request(self, core_id, *args):
            seen.append(core_id in eng._requests)  # the state already exists when the core is called
            raise KeyboardInterrupt

        def __getattr__(self, name):
            return getattr(self._core, name)

    monkeypatch.setattr(eng, "core", RefusingCore(eng.core))
    with pytest.raises(KeyboardInterrupt):
        eng.add_request("r", GOOD_PROMPT, GREEDY)
    assert seen == [True] and not eng._requests and not eng._by_name
    monkeypatch.undo()
    eng.add_request("r", GOOD_PROMPT, GREEDY)  # the same name is free again
    while eng.has_unfinished_requests():
        eng.step()
    assert_serves(gen, reference)


def test_max_tokens_beyond_max_model_len_is_clamped_like_vllm(gen, reference):
    """As vLLM's offline engine does: the request stops with "length" at max_model_len."""
    out = gen.generate([GOOD_PROMPT], SamplingParams(max_tokens=10**30, min_tokens=10**20, temperature=0.0),
                       use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 64 - len(GOOD_PROMPT)
    assert_serves(gen, reference)


# ------------------------------------------------------------------ engine options
@pytest.mark.parametrize("kwargs,match", [
    ({"seed": -1}, r"seed must be an integer in \[0, 2\*\*64\)"),
    ({"seed": 2**64}, "seed must be"),
    ({"seed": 1.5}, "seed must be"),
    ({"max_logprobs": -1}, "max_logprobs must be an integer >= 0"),
    ({"max_logprobs": "20"}, "max_logprobs must be"),
])
def test_bad_engine_options(tiny, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Generator(str(tiny), **kwargs)


def test_max_logprobs_is_an_engine_option(tiny):
    gen = Generator(str(tiny), max_model_len=64, block_size=4, num_kv_blocks=32, max_logprobs=40)
    out = gen.generate([GOOD_PROMPT], SamplingParams(max_tokens=3, temperature=0.0, logprobs=40), use_tqdm=False)[0]
    assert [len(e) for e in out.logprobs] == [40] * 3  # the chosen token is among the top 40 (greedy)
    with pytest.raises(ValueError, match="logprobs=41"):
        gen.generate([GOOD_PROMPT], SamplingParams(max_tokens=3, logprobs=41), use_tqdm=False)
    # the vocabulary (256) caps it too
    small = Generator(str(tiny), max_model_len=64, block_size=4, num_kv_blocks=32, max_logprobs=1000)
    with pytest.raises(ValueError, match="vocabulary size 256"):
        small.generate([GOOD_PROMPT], SamplingParams(max_tokens=3, logprobs=257), use_tqdm=False)
    assert_serves(gen)


# ------------------------------------------------------------------ ignore_eos and several EOS ids
def test_ignore_eos_ignores_every_eos_id(tiny, reference, tmp_path):
    """generation_config lists two EOS ids; the second is a token greedy decoding emits. Without
    ignore_eos the request stops there; with it, it runs to max_tokens (it used to stop too)."""
    second = next(t for j, t in enumerate(reference) if j >= 2 and t not in reference[:j] and t != 2)
    at = reference.index(second)
    two_eos = tmp_path / "two_eos"
    shutil.copytree(tiny, two_eos)
    (two_eos / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, second]}))
    g = Generator(str(two_eos), max_model_len=64, block_size=4, num_kv_blocks=32)
    assert g.engine.loaded.eos_token_ids == (2, second)
    stops, ignores = g.generate([GOOD_PROMPT] * 2, [SamplingParams(max_tokens=12, temperature=0.0),
                                                    SamplingParams(max_tokens=12, temperature=0.0,
                                                                   ignore_eos=True)], use_tqdm=False)
    assert stops.token_ids == reference[:at + 1] and stops.finish_reason == "stop"
    assert ignores.token_ids == reference and ignores.finish_reason == "length"
    # min_tokens blocks every EOS id, so the request runs past `second` but stops at it later
    later = g.generate([GOOD_PROMPT], SamplingParams(max_tokens=12, temperature=0.0, min_tokens=at + 1),
                       use_tqdm=False)[0]
    assert later.token_ids[:at] == reference[:at] and later.token_ids[at] != second
    assert later.finish_reason == "length" or later.token_ids[-1] in (2, second)


def test_gguf_eos_and_eot_are_both_eos(tmp_path):
    from specinfer.loader.gguf_weights import gguf_config

    cfg = gguf_config(_gguf_meta(eos=260, eot=261), set(), "x.gguf")
    assert cfg.eos_token_ids == (260, 261)


# ------------------------------------------------------------------ broken HF model directories
def _broken_copy(tiny, tmp_path, name, edit):
    d = tmp_path / name
    shutil.copytree(tiny, d)
    edit(d)
    return d


def _edit_json(file, **changes):
    def edit(d):
        path = d / file
        obj = json.loads(path.read_text()) if path.exists() else {}
        for k, v in changes.items():
            if v is _DELETE:
                obj.pop(k, None)
            else:
                obj[k] = v
        path.write_text(json.dumps(obj))
    return edit


_DELETE = object()


def _sharded(weight_map_name):
    def edit(d):
        st = next(d.glob("*.safetensors"))
        from safetensors import safe_open

        with safe_open(str(st), "pt") as f:
            names = list(f.keys())
        (d / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {n: (weight_map_name if i == 0 else st.name) for i, n in enumerate(names)}}))
    return edit


@pytest.mark.parametrize("name,edit,match", [
    ("heads_not_dividing", _edit_json("config.json", num_attention_heads=3, num_key_value_heads=3, head_dim=_DELETE),
     r"num_attention_heads \(3\) does not divide hidden_size \(64\)"),
    ("kv_heads_not_dividing", _edit_json("config.json", num_key_value_heads=3),
     r"num_key_value_heads \(3\) does not divide num_attention_heads \(4\)"),
    ("zero_heads", _edit_json("config.json", num_attention_heads=0), "'num_attention_heads' must be a positive"),
    ("missing_hidden_size", _edit_json("config.json", hidden_size=_DELETE), "missing field 'hidden_size'"),
    ("string_vocab", _edit_json("config.json", vocab_size="256"), "'vocab_size' must be a positive integer"),
    ("rope_scaling_list", _edit_json("config.json", rope_scaling=[1, 2]), "'rope_scaling' must be an object"),
    ("config_bos", _edit_json("config.json", bos_token_id=999), r"config.json: bos_token_id = 999 is outside"),
    ("config_eos", _edit_json("config.json", eos_token_id=[2, 256]), r"config.json: eos_token_id = 256 is outside"),
    ("gen_eos", _edit_json("generation_config.json", eos_token_id=[2, 300]),
     r"generation_config.json: eos_token_id = 300 is outside the vocabulary \[0, 256\)"),
    ("gen_eos_type", _edit_json("generation_config.json", eos_token_id="</s>"),
     "generation_config.json: eos_token_id must be a token id"),
    ("shard_escapes", _sharded("../outside.safetensors"), "shard '../outside.safetensors' resolves outside"),
    ("shard_absolute", _sharded("/etc/hostname"), "shard '/etc/hostname' resolves outside"),
    ("shard_not_a_name", _edit_json("model.safetensors.index.json", weight_map={"a": 5}), "shard names"),
    ("config_not_object", lambda d: (d / "config.json").write_text("[1, 2]"), "expected a JSON object"),
])
def test_broken_hf_dirs_are_refused_naming_the_field(gen, reference, tiny, tmp_path, name, edit, match):
    d = _broken_copy(tiny, tmp_path, name, edit)
    with pytest.raises(ValueError, match=match):
        Generator(str(d), max_model_len=64, block_size=4, num_kv_blocks=32)
    assert_serves(gen, reference)


# ------------------------------------------------------------------ broken GGUF files
def _gguf_meta(**over):
    tokens = [f"t{i}" for i in range(300)]
    meta = {"general.architecture": "llama", "llama.block_count": 1, "llama.context_length": 64,
            "llama.embedding_length": 64, "llama.feed_forward_length": 128, "llama.attention.head_count": 4,
            "llama.attention.head_count_kv": 2, "llama.attention.layer_norm_rms_epsilon": 1e-5,
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    for k, v in over.items():
        key = {"eos": "tokenizer.ggml.eos_token_id", "eot": "tokenizer.ggml.eot_token_id",
               "bos": "tokenizer.ggml.bos_token_id", "tokens": "tokenizer.ggml.tokens",
               "heads": "llama.attention.head_count", "kv_heads": "llama.attention.head_count_kv",
               "types": "tokenizer.ggml.token_type", "merges": "tokenizer.ggml.merges",
               "vocab": "llama.vocab_size"}[k]
        if v is _DELETE:
            meta.pop(key)
        else:
            meta[key] = v
    return meta


def _write_gguf(path, meta):
    """A metadata-only GGUF file (no tensors): enough for every metadata check."""
    w = gguf.GGUFWriter(str(path), meta["general.architecture"])
    for key, value in meta.items():
        if key == "general.architecture":
            continue
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_uint32(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("over,match", [
    ({"tokens": _DELETE}, "missing or empty GGUF tokenizer array tokenizer.ggml.tokens"),
    ({"heads": 3}, r"llama.attention.head_count \(3\) does not divide llama.embedding_length \(64\)"),
    ({"heads": 0}, "llama.attention.head_count must be a positive integer"),
    ({"kv_heads": 3}, r"llama.attention.head_count_kv \(3\) does not divide llama.attention.head_count"),
    ({"eos": 9999}, r"tokenizer.ggml.eos_token_id = 9999 is outside the vocabulary \[0, 300\)"),
    ({"bos": 300}, "tokenizer.ggml.bos_token_id = 300 is outside the vocabulary"),
    ({"eot": 400}, "tokenizer.ggml.eot_token_id = 400"),
    ({"types": [1] * 299}, "tokenizer.ggml.token_type has 299 entries for 300 tokens"),
    ({"merges": ["t0t1"]}, "tokenizer.ggml.merges must be a list of \"left right\" strings"),
    ({"vocab": 200}, r"tokenizer.ggml.tokens has 300 tokens, more than llama.vocab_size \(200\)"),
])
def test_broken_gguf_is_refused_naming_the_field(gen, reference, tmp_path, over, match):
    path = _write_gguf(tmp_path / "broken.gguf", _gguf_meta(**over))
    with pytest.raises(ValueError, match=match):
        load_model(path)
    assert_serves(gen, reference)


def test_gguf_with_good_metadata_only_fails_for_its_missing_tensors(tmp_path):
    """The control for the test above: the same file without the defect passes every metadata
    check and is refused only for having no tensors."""
    path = _write_gguf(tmp_path / "good_meta.gguf", _gguf_meta())
    with pytest.raises(ValueError, match="missing tensors"):
        load_model(path)


# ------------------------------------------------------------------ the CLI
def run_cli(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, "-m", "specinfer", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("case", ["seed", "heads", "gguf_eos"])
def test_cli_bad_input_is_one_line_exit_2(tiny, tmp_path, case):
    if case == "seed":
        args = [tiny, "--prompt", "t5", "--seed", 2**64]
        fragment = "--seed must be an integer in [0, 2**64)"
    elif case == "heads":
        d = _broken_copy(tiny, tmp_path, "cli_heads", _edit_json("config.json", num_key_value_heads=3))
        args, fragment = [d, "--prompt", "t5"], "num_key_value_heads (3) does not divide num_attention_heads (4)"
    else:
        path = _write_gguf(tmp_path / "cli.gguf", _gguf_meta(eos=9999))
        args, fragment = [path, "--prompt", "t5"], "tokenizer.ggml.eos_token_id = 9999 is outside the vocabulary"
    proc = run_cli("generate", *args)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specinfer generate: error: ") and fragment in lines[0], lines


@pytest.mark.parametrize("spec, method", [
    ({"model": "qwen2.5-coder-0.5b"}, "draft_model"),  # vLLM infers the method from the model
    ({"model": "smollm2-135m-eagle"}, "eagle"),
    ({"model": "heads/EAGLE3-LLaMA3.1-Instruct-8B"}, "eagle3"),
    ({"model": "smollm2-135m-medusa"}, "medusa"),
    ({"model": "ibm-ai-platform/llama3-8b-accelerator-mlp_speculator"}, "mlp_speculator"),
    ({"exit_layer": 3}, "layer_skip"),
    ({"num_speculative_tokens": 3}, "ngram"),
    ({"method": "ngram"}, "ngram"),
])
def test_speculative_method_is_inferred_when_omitted(spec, method):
    from specinfer.spec_decode.config import SpeculativeConfig

    assert SpeculativeConfig.from_any(spec).method == method


def test_a_draft_model_given_without_a_method_drafts(target_and_draft):
    target, draft = target_and_draft
    gen = Generator(str(target), speculative={"model": str(draft), "num_speculative_tokens": 3, "policy": "fixed"})
    assert gen.engine.spec.method == "draft_model"
    gen.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    assert gen.spec_metrics()["num_draft_tokens"] > 0
