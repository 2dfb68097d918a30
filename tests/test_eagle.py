"""EAGLE-1: checkpoints in the public layout load; every draft the engine proposes equals the
HF-transformers reference recomputed from the whole history (so the paged draft KV stays right
through chunked prefill, prefix-cache hits, preemption and steps with speculation disabled);
greedy output equals the target's alone with both scorers; malformed checkpoints are refused."""
import json

import pytest
from safetensors.torch import load_file, save_file

import head_checkpoints as hc
from eagle_reference import EagleReference
from specinfer import Generator, SamplingParams
from spec_cases import GREEDY, check_greedy_exact, prompts, reference
from head_drafts import check_drafts_equal_reference, record_proposals, splits


@pytest.mark.parametrize("variant", ["bias_safetensors", "nobias_bin_embed", "draft_vocab"])
def test_eagle_drafts_equal_the_reference(target, tmp_path, variant):
    kw = {"bias_safetensors": dict(bias=True), "nobias_bin_embed": dict(bias=False, pt=True, embed=True),
          "draft_vocab": dict(draft_vocab=64)}[variant]
    path = hc.eagle1(tmp_path / "eagle", target, **kw)
    reference_drafts = EagleReference(target, path)
    _, seen = check_drafts_equal_reference(target, path, reference_drafts, "eagle")
    if variant == "draft_vocab":  # drafts never leave the draft vocabulary
        vocab = set(reference_drafts.vocab.tolist())
        assert len(vocab) == 64 and all(d in vocab for _, ds in seen for d in ds)


def test_eagle_drafts_equal_the_reference_across_split_proposals(target, tmp_path):
    """A token budget of 8 with k = 5 cuts proposals: parts are verified without a bonus row."""
    path = hc.eagle1(tmp_path / "eagle", target)
    reference_drafts = EagleReference(target, path)
    gen = Generator(str(target), block_size=4, max_num_batched_tokens=8, num_kv_blocks=64, max_model_len=128,
                    speculative={"method": "eagle", "model": str(path), "quantization": "none", "num_speculative_tokens": 5,
                                 "policy": "fixed"})
    splits[0] = 0
    seen = record_proposals(gen)
    gen.generate(prompts(4), SamplingParams(max_tokens=20, temperature=0.0), use_tqdm=False)
    assert splits[0] > 0 and len(seen) > 10
    for tokens, drafts in seen:
        assert drafts == reference_drafts.drafts(tokens, len(drafts)), len(tokens)


def test_eagle_keeps_up_while_speculation_is_disabled(target, tmp_path):
    """disable_by_batch_size: no drafts while many requests run, but the draft KV must still take
    in those steps' target states, or the drafts proposed afterwards are wrong."""
    path = hc.eagle1(tmp_path / "eagle", target)
    reference_drafts = EagleReference(target, path)
    gen = Generator(str(target), max_model_len=128, num_kv_blocks=64, speculative={
        "method": "eagle", "model": str(path), "quantization": "none", "num_speculative_tokens": 2, "disable_by_batch_size": 4,
        "policy": "fixed"})  # drafts counted below: every proposal k, not the goodput policy's choice
    seen = record_proposals(gen)
    ps = prompts(6)
    params = [SamplingParams(max_tokens=6 + 4 * i, temperature=0.0) for i in range(6)]  # staggered finishes
    gen.generate(ps, params, use_tqdm=False)
    late = [(t, d) for t, d in seen if d and len(t) > len(ps[4]) + 8]
    assert len(late) > 5
    for tokens, drafts in late:
        assert drafts == reference_drafts.drafts(tokens, len(drafts))


@pytest.mark.parametrize("scorer", ["mqa", pytest.param("batch_expansion", marks=pytest.mark.slow)])
def test_eagle_greedy_is_exact(target, ref, tmp_path, scorer):
    path = hc.eagle1(tmp_path / "eagle", target, repeat=True)
    tot = check_greedy_exact(target, {"method": "eagle", "model": str(path), "num_speculative_tokens": 3,
                                      "scorer": scorer}, ref)
    assert 0 < tot["num_accepted_tokens"] < tot["num_draft_tokens"], tot


@pytest.mark.parametrize("draft_vocab", [None, 64])
def test_eagle_save_load_round_trip_gives_identical_proposals(target, tmp_path, draft_vocab):
    path = hc.eagle1(tmp_path / "eagle", target, bias=True, bias_key=False,  # no "bias" key means a bias
                     draft_vocab=draft_vocab)
    cfg = json.loads((path / "config.json").read_text())
    assert "bias" not in cfg
    runs = []
    for p in (path, tmp_path / "saved"):
        gen = Generator(str(target), block_size=4, max_model_len=128, num_kv_blocks=64,
                        speculative={"method": "eagle", "model": str(p), "quantization": "none", "num_speculative_tokens": 3,
                                     "policy": "fixed"})
        if p == path:
            gen.engine.proposer.draft.save(tmp_path / "saved")
        seen = record_proposals(gen)
        gen.generate(prompts(6), GREEDY, use_tqdm=False)
        runs.append(seen)
    assert runs[0] == runs[1] and len(runs[0]) > 20


def _spoil(path, file, edit=None, **config):
    if edit is not None:
        t = load_file(str(path / file))
        edit(t)
        save_file(t, str(path / file))
    if config:
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(config)
        (path / "config.json").write_text(json.dumps(cfg))


MALFORMED = {
    "missing_fc": (dict(), lambda p: _spoil(p, "model.safetensors", lambda t: t.pop("fc.weight")), "fc.weight"),
    "bias_default_true_but_absent": (dict(bias=False, bias_key=False), lambda p: None, "fc.bias"),
    "wrong_shape": (dict(), lambda p: _spoil(p, "model.safetensors", lambda t: t.update(
        {"layers.0.mlp.down_proj.weight": t["layers.0.mlp.down_proj.weight"][:, :-1].contiguous()})),
        "down_proj.weight"),
    "hidden_size": (dict(), lambda p: _spoil(p, "model.safetensors", hidden_size=32), "hidden_size"),
    "vocabulary": (dict(), lambda p: _spoil(p, "model.safetensors", vocab_size=300), "vocab_size"),
    "two_layers": (dict(), lambda p: _spoil(p, "model.safetensors", num_hidden_layers=2), "num_hidden_layers"),
    "draft_vocab_without_d2t": (dict(draft_vocab=64), lambda p: _spoil(p, "model.safetensors",
                                                                        lambda t: t.pop("d2t")), "d2t"),
    "d2t_out_of_range": (dict(draft_vocab=64), lambda p: _spoil(p, "model.safetensors", lambda t: t.update(
        {"d2t": t["d2t"] + 1000})), "d2t"),
    "d2t_wrong_length": (dict(draft_vocab=64), lambda p: _spoil(p, "model.safetensors", draft_vocab_size=63), "d2t"),
    "draft_vocab_size_not_int": (dict(draft_vocab=64), lambda p: _spoil(p, "model.safetensors",
                                                                         draft_vocab_size="64"), "draft_vocab_size"),
    "lm_head_would_be_ignored": (dict(), lambda p: _spoil(p, "model.safetensors", lambda t: t.update(
        {"lm_head.weight": t["fc.weight"][:, :64].repeat(4, 1).contiguous()})), "lm_head.weight"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_eagle_checkpoint_is_refused(target, tmp_path, name):
    kw, spoil, match = MALFORMED[name]
    path = hc.eagle1(tmp_path / name, target, **kw)
    spoil(path)
    with pytest.raises(ValueError, match=match):
        Generator(str(target), speculative={"method": "eagle", "model": str(path)})


# ---------------------------------------------------------------------------------------- EAGLE-3
@pytest.mark.parametrize("variant", ["default_aux_truncated", "explicit_aux_full_vocab"])
def test_eagle3_drafts_equal_the_reference(tiny_dir, tmp_path, variant):
    from eagle_reference import Eagle3Reference

    if variant == "default_aux_truncated":  # 8 layers: aux {2, 4, 5}; draft vocabulary of 96 ids
        target = tiny_dir("llama", False, layers=8)[0]
        path = hc.eagle3(tmp_path / "e3", target, draft_vocab=96)
    else:  # 4 layers, ids from eagle_config (unsorted: collected in layer order), layers.0.* key names
        target = tiny_dir("llama", False, layers=4)[0]
        path = hc.eagle3(tmp_path / "e3", target, aux_ids=[3, 0, 1], layers_prefix=True, t2d=False)
    check_drafts_equal_reference(target, path, Eagle3Reference(target, path), "eagle3")


@pytest.fixture(scope="module")
def ref4(tiny_dir):
    target = tiny_dir("llama", False, layers=4)[0]
    return target, reference(target)


@pytest.mark.parametrize("scorer", [pytest.param("mqa", marks=pytest.mark.slow), "batch_expansion"])
def test_eagle3_greedy_is_exact(ref4, tmp_path, scorer):
    target, ref = ref4
    path = hc.eagle3(tmp_path / "e3", target, draft_vocab=96, aux_ids=[0, 1, 3])
    check_greedy_exact(target, {"method": "eagle3", "model": str(path), "num_speculative_tokens": 3,
                                "scorer": scorer}, ref)


def test_eagle3_save_load_round_trip_gives_identical_proposals(tiny_dir, tmp_path):
    target = tiny_dir("llama", False, layers=4)[0]
    path = hc.eagle3(tmp_path / "e3", target, aux_ids=[3, 0, 1], draft_vocab=128)
    runs = []
    for p in (path, tmp_path / "saved"):
        gen = Generator(str(target), block_size=4, max_model_len=128, num_kv_blocks=64,
                        speculative={"method": "eagle3", "model": str(p), "quantization": "none", "num_speculative_tokens": 3,
                                     "policy": "fixed"})
        if p == path:
            gen.engine.proposer.draft.save(tmp_path / "saved")
        seen = record_proposals(gen)
        gen.generate(prompts(6), GREEDY, use_tqdm=False)
        runs.append(seen)
    assert runs[0] == runs[1] and len(runs[0]) > 20


MALFORMED3 = {
    "missing_d2t": (dict(draft_vocab=96), lambda p: _spoil(p, "model.safetensors", lambda t: t.pop("d2t")), "d2t"),
    "t2d_disagrees": (dict(draft_vocab=96), lambda p: _spoil(p, "model.safetensors", lambda t: t.update(
        {"t2d": t["t2d"].roll(1)})), "t2d"),
    "d2t_out_of_range": (dict(draft_vocab=96), lambda p: _spoil(p, "model.safetensors", lambda t: t.update(
        {"d2t": t["d2t"] + 300})), "d2t"),
    "narrow_attention_input": (dict(), lambda p: _spoil(p, "model.safetensors", lambda t: t.update(
        {"midlayer.self_attn.q_proj.weight": t["midlayer.self_attn.q_proj.weight"][:, :64].contiguous()})),
        "q_proj.weight"),
    "missing_hidden_norm": (dict(), lambda p: _spoil(p, "model.safetensors",
                                                     lambda t: t.pop("midlayer.hidden_norm.weight")), "hidden_norm"),
    "target_hidden_size": (dict(), lambda p: _spoil(p, "model.safetensors", target_hidden_size=32),
                           "target_hidden_size"),
    "draft_vocab_size": (dict(), lambda p: _spoil(p, "model.safetensors", draft_vocab_size=300), "draft_vocab_size"),
    "aux_layer_ids": (dict(aux_ids=[0, 1, 9]), lambda p: None, "eagle_aux_hidden_state_layer_ids"),
}


@pytest.mark.parametrize("name", list(MALFORMED3))
def test_malformed_eagle3_checkpoint_is_refused(tiny_dir, tmp_path, name):
    target = tiny_dir("llama", False, layers=4)[0]
    kw, spoil, match = MALFORMED3[name]
    path = hc.eagle3(tmp_path / name, target, **{"aux_ids": [0, 1, 3], **kw})
    spoil(path)
    with pytest.raises(ValueError, match=match):
        Generator(str(target), speculative={"method": "eagle3", "model": str(path)})


def test_eagle3_default_aux_layers_need_seven_target_layers(tiny_dir, tmp_path):
    target = tiny_dir("llama", False, layers=4)[0]
    path = hc.eagle3(tmp_path / "e3", target)
    with pytest.raises(ValueError, match="aux layers"):
        Generator(str(target), speculative={"method": "eagle3", "model": str(path)})
