"""Bad input is refused with a ValueError naming the field, before any work starts, and the
same generator keeps serving normal requests afterwards."""
import math

import pytest

from specinfer import Generator, SamplingParams


@pytest.fixture(scope="module")
def gen(tiny_dir):
    path, _ = tiny_dir("llama", False)
    return Generator(str(path), max_model_len=64, block_size=4, num_kv_blocks=32)


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.1}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"seed": 1.5}, "seed"),
    ({"logprobs": -1}, "logprobs"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt,match", [
    ("", "empty"),
    ([], "empty"),
    ([5, 300, 7], "vocabulary"),
    ([5, -1], "vocabulary"),
    (list(range(3, 80)), "max_model_len"),
    (3.5, "prompt must be"),
])
def test_bad_prompts_then_serving_continues(gen, prompt, match):
    good = [5, 6, 7]
    with pytest.raises(ValueError, match=match):
        gen.generate([good, prompt], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert not gen.engine.has_unfinished_requests()  # the good prompt was not started either
    out = gen.generate([good], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)[0]
    assert len(out.token_ids) >= 1 and out.finished


def test_mismatched_params_list(gen):
    with pytest.raises(ValueError, match="sampling_params"):
        gen.generate([[5], [6]], [SamplingParams()], use_tqdm=False)


def test_missing_and_unsupported_models(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        Generator(str(tmp_path / "nope"))
    d = tmp_path / "gpt2ish"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="(?i)gpt2|architecture"):
        Generator(str(d))


def test_corrupted_weights_name_the_file(tiny_dir, tmp_path):
    import shutil

    path, _ = tiny_dir("llama", False)
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    st = next(broken.glob("*.safetensors"))
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    with pytest.raises((ValueError, OSError), match=st.name):
        Generator(str(broken))


def test_kv_pool_too_small_is_refused_at_construction(tiny_dir):
    path, _ = tiny_dir("llama", False)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        Generator(str(path), max_model_len=128, block_size=4, num_kv_blocks=31)
    Generator(str(path), max_model_len=128, block_size=4, num_kv_blocks=32)  # exactly enough


@pytest.mark.parametrize("kwargs,field", [
    ({"block_size": 0}, "block_size"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ({"max_model_len": 100000}, "max_model_len"),
    ({"dtype": "int3"}, "dtype"),
    ({"device": "tpu"}, "device"),
])
def test_bad_engine_arguments(tiny_dir, kwargs, field):
    path, _ = tiny_dir("llama", False)
    with pytest.raises(ValueError, match=field):
        Generator(str(path), **kwargs)


def test_abort_and_streaming(gen):
    eng = gen.engine
    eng.add_request("a", [5, 6, 7], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    eng.add_request("b", [8, 9], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    with pytest.raises(ValueError, match="request_id"):
        eng.add_request("a", [1], SamplingParams())
    eng.step()
    aborted = eng.abort("a")
    assert aborted.finish_reason == "abort" and aborted.finished
    assert eng.abort("a") is None
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.core.num_free_blocks() == eng.core.num_total_blocks()
    pieces = list(gen.stream([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)))
    assert pieces[-1].finished and pieces[-1].finish_reason == "length"
    assert sum(len(p.new_token_ids) for p in pieces) == 6 == len(pieces[-1].token_ids)
    assert "".join(p.new_text for p in pieces) == pieces[-1].text


def test_default_max_model_len_is_capped_to_the_kv_pool(tiny_dir):
    path, _ = tiny_dir("llama", False)
    with pytest.warns(UserWarning, match="max_model_len capped at 64"):
        gen = Generator(str(path), block_size=4, num_kv_blocks=16)  # the model allows 512
    assert gen.engine.max_model_len == 64
    with pytest.raises(ValueError, match="max_model_len"):
        gen.generate([list(range(3, 70))], SamplingParams(max_tokens=2), use_tqdm=False)
    gen.reset_metrics()
    assert gen.spec_metrics()["num_drafts"] == 0


def test_model_files_are_read_with_limits(tiny_dir, tmp_path, monkeypatch):
    """Model files are untrusted: a config.json past the size limit (or not a regular file) and a
    config whose sizes the weights cannot back are clear ValueErrors, before any allocation."""
    import json
    import shutil

    from specinfer.loader import hf

    src, _ = tiny_dir("llama", False)
    d = tmp_path / "m"
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "hidden_size": 2**20, "intermediate_size": 2**22}))
    with pytest.raises(ValueError, match="does not belong to these weights"):
        Generator(str(d))
    (d / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(hf, "MAX_JSON_BYTES", 64)
    with pytest.raises(ValueError, match="larger than 64 bytes"):
        Generator(str(d))
