"""Named draft heads: speculative.model names a recipe; the head is trained once by train-heads'
own pipeline, cached under a key of the recipe, then loaded; an interrupted training leaves no
head behind; a head for another method or target is refused."""
import pytest

from specinfer import Generator, SamplingParams
from specinfer.training import head_training
from specinfer.training import trained_heads as th


@pytest.fixture(scope="module")
def target(tiny_dir):
    return str(tiny_dir("llama", False)[0])


def _recipe(target, steps=15, method="eagle"):
    return th.HeadRecipe("tiny-eagle", target, method, prompts=10, max_tokens=20, steps=steps, num_heads=3,
                         draft_vocab_size=96)


def test_a_name_is_trained_once_then_reused(target, tmp_path, monkeypatch):
    table = {"tiny-eagle": _recipe(target)}
    path = th.resolve_head("tiny-eagle", "eagle", target, table=table, cache_dir=tmp_path, progress=False)
    assert len(list(tmp_path.glob("distill-*.pt"))) == 1  # the data, kept for the target's other heads
    assert path.startswith(str(tmp_path / "tiny-eagle-")) and (th.Path(path) / "model.safetensors").is_file()
    assert not (th.Path(path) / "train_state.pt").exists()
    assert not list(tmp_path.glob("*.partial"))

    def no_training(*a, **k):
        raise AssertionError("trained again")

    monkeypatch.setattr(head_training, "train_head", no_training)
    assert th.resolve_head("tiny-eagle", "eagle", target, table=table, cache_dir=tmp_path) == path
    # another recipe (more steps) is another entry: trained anew, never the old head
    with pytest.raises(AssertionError, match="trained again"):
        th.resolve_head("tiny-eagle", "eagle", target, table={"tiny-eagle": _recipe(target, steps=16)},
                        cache_dir=tmp_path)


def test_the_engine_resolves_a_named_head_and_speculates_exactly(target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECINFER_CACHE", str(tmp_path / "packs"))
    monkeypatch.setitem(th.TRAINED_HEADS, "tiny-eagle", _recipe(target))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    want = Generator(target).generate(prompts, params, use_tqdm=False)
    gen = Generator(target, speculative={"method": "eagle", "model": "tiny-eagle", "num_speculative_tokens": 3})
    got = gen.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert gen.spec_metrics()["num_draft_tokens"] > 0
    assert list((tmp_path / "heads").glob("tiny-eagle-*/model.safetensors"))


def test_an_interrupted_training_leaves_no_head(target, tmp_path, monkeypatch):
    table = {"tiny-eagle": _recipe(target)}
    real = head_training.train_head

    def interrupted(target_model, out, *a, **k):
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(head_training, "train_head", interrupted)
    with pytest.raises(KeyboardInterrupt):
        th.resolve_head("tiny-eagle", "eagle", target, table=table, cache_dir=tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("tiny-eagle-")]
    monkeypatch.setattr(head_training, "train_head", real)
    path = th.resolve_head("tiny-eagle", "eagle", target, table=table, cache_dir=tmp_path, progress=False)
    from safetensors.torch import load_file

    assert "fc.weight" in load_file(str(th.Path(path) / "model.safetensors"))


def test_refusals(target, tmp_path):
    table = {"tiny-eagle": _recipe(target)}
    with pytest.raises(ValueError, match="is a eagle head; speculative.method is 'medusa'"):
        th.resolve_head("tiny-eagle", "medusa", target, table=table, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="trained for the target"):
        th.resolve_head("tiny-eagle", "eagle", str(tmp_path), table=table, cache_dir=tmp_path)
    assert th.resolve_head("/some/dir", "eagle", target, table=table) == "/some/dir"  # not a name: as given
    assert not list(tmp_path.iterdir())


def test_builtin_recipes_name_their_pack_and_differ_in_key():
    from specinfer.packs import is_pack_name

    keys = set()
    for name, r in th.TRAINED_HEADS.items():
        assert r.name == name and is_pack_name(r.target) and r.method in head_training.TRAINABLE
        keys.add(r.key("bfloat16"))
        assert r.key("bfloat16") != r.key("float32")
    assert len(keys) == len(th.TRAINED_HEADS)
