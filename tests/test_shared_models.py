"""engine/model_loading.shared_models(): engines built inside share one prepared copy of a model
with the same settings (the bench runs every method in it), give the same tokens as engines with
their own copies, and nothing is shared outside it."""
import torch

from specinfer import Generator, SamplingParams
from specinfer.loader.model_loading import shared_models

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 14, 3, 5, 9, 14], [7, 8, 22]]


def _weights(gen) -> torch.nn.Module:
    return gen.engine.executor.target_runner.model


def _gen(path, **kw):
    return Generator(str(path), max_model_len=64, num_kv_blocks=32, enable_prefix_caching=False, **kw)


def _tokens(gen, prompts=PROMPTS):
    return [list(o.token_ids) for o in gen.generate(prompts, PARAMS, use_tqdm=False)]


def test_engines_inside_share_one_copy_and_outputs_are_unchanged(target):
    alone = _tokens(_gen(target))
    with shared_models():
        plain = _gen(target)
        spec = _gen(target, speculative={"method": "ngram", "num_speculative_tokens": 3})
        other_dtype = _gen(target, dtype="bfloat16")
        assert _weights(plain) is _weights(spec)
        assert _weights(other_dtype) is not _weights(plain)
        # interleaved runs on the shared weights: each engine keeps its own KV and its own tokens
        assert _tokens(plain) == alone
        assert _tokens(spec) == alone
        assert _tokens(plain, PROMPTS[::-1]) == alone[::-1]
    after = _gen(target)
    assert _weights(after) is not _weights(plain)
    assert _tokens(after) == alone


def test_nothing_is_shared_outside(target):
    a, b = _gen(target), _gen(target)
    assert _weights(a) is not _weights(b)
    assert _weights(a).embed_tokens.data_ptr() != _weights(b).embed_tokens.data_ptr()


def test_nesting_keeps_the_outer_registry(target):
    with shared_models():
        a = _gen(target)
        with shared_models():
            b = _gen(target)
        c = _gen(target)
    assert _weights(a) is _weights(b) is _weights(c)
