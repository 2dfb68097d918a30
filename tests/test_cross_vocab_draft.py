"""Draft models with another tokenizer (method "draft_model", vocabularies differ): the draft's
text continuation is re-tokenized for the target at the boundary and verified there. Greedy output
equals the target's alone (through chunked prefill and preemption, batched); a draft that is the
target under a permuted vocabulary (same text, other ids) is accepted almost always, so the
translation really carries the draft's tokens across; sampling keeps the target's law (the drafts
are deterministic: q one-hot), by chi-square."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from specinfer import Generator, SamplingParams
from stats import ALPHA, chi_square_pvalue

from engine_law import NUM, sample_counts


def permuted_copy(src, dst, perm: np.ndarray) -> None:
    """The model at `src` with token i renamed perm[i]: embedding and lm_head rows and the
    tokenizer's ids moved together, so it computes the same text distribution under other ids."""
    if src != dst:
        shutil.copytree(src, dst, dirs_exist_ok=True)
    inv = np.argsort(perm)
    for f in dst.glob("*.safetensors"):
        sd = load_file(f)
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in sd:
                sd[name] = sd[name][torch.from_numpy(inv)].contiguous()
        save_file(sd, f, metadata={"format": "pt"})
    tok = json.loads((dst / "tokenizer.json").read_text())
    tok["model"]["vocab"] = {t: int(perm[i]) for t, i in tok["model"]["vocab"].items()}
    for a in tok.get("added_tokens", []):
        a["id"] = int(perm[a["id"]])
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((dst / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id"):
        if isinstance(cfg.get(key), int):
            cfg[key] = int(perm[cfg[key]])
    (dst / "config.json").write_text(json.dumps(cfg))


def _perm(vocab: int, fixed: int = 3, seed: int = 0) -> np.ndarray:
    """A permutation of the ids that keeps the specials (ids < fixed) in place."""
    rest = np.random.default_rng(seed).permutation(np.arange(fixed, vocab))
    return np.concatenate([np.arange(fixed), rest])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A target with a word vocabulary (t0 .. t255, text "t5 t6 ..."), its permuted-vocabulary
    copy, and another random model under another permutation."""
    from tiny_models import VOCAB, build_tiny_model

    target = tmp_path_factory.mktemp("xv_target")
    build_tiny_model(target, "llama", scale=2.0, seed=5)
    twin = tmp_path_factory.mktemp("xv_twin")
    permuted_copy(target, twin, _perm(VOCAB))
    other = tmp_path_factory.mktemp("xv_other")
    build_tiny_model(other, "llama", scale=2.0, seed=6)
    permuted_copy(other, other, _perm(VOCAB, seed=1))  # another model, another vocabulary
    return target, twin, other


PROMPTS = [list(range(40, 40 + n)) for n in (5, 17, 33, 60)] + [[100, 101, 102] * 9]
GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


def test_the_twin_vocabularies_differ(models):
    target, twin, _ = models
    a = json.loads((target / "tokenizer.json").read_text())["model"]["vocab"]
    b = json.loads((twin / "tokenizer.json").read_text())["model"]["vocab"]
    assert set(a) == set(b) and sum(a[t] != b[t] for t in a) > 200


@pytest.mark.parametrize("which", ["twin", "other"])
def test_greedy_equals_the_target_alone(models, which):
    target, twin, other = models
    draft = twin if which == "twin" else other
    want = Generator(str(target), max_model_len=256).generate(PROMPTS, GREEDY, use_tqdm=False)
    # 4-token blocks, a 24-token budget, a small pool: chunked prefill beside verification, preemption
    gen = Generator(str(target), block_size=4, max_num_batched_tokens=24, num_kv_blocks=26, max_model_len=96,
                    speculative={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4,
                                 "policy": "fixed"})
    outs = gen.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [w.token_ids for w in want]
    m = gen.spec_metrics()
    assert m["num_draft_tokens"] > 50, m
    if which == "twin":  # the same model under other ids: its drafts are the target's own choices
        assert m["acceptance_rate"] > 0.9, m
    assert gen.engine.core.stats()["num_preemptions"] > 0
    assert gen.engine.core.num_free_blocks() == gen.engine.core.num_total_blocks()


def test_sampling_keeps_the_target_law(law_models, exact_law, tmp_path):
    target, _, _ = law_models
    twin = tmp_path / "law_twin"
    permuted_copy(target, twin, _perm(8, fixed=0, seed=4))  # word tokens t0..t7 renamed
    counts, m = sample_counts(target, {"method": "draft_model", "model": str(twin), "num_speculative_tokens": 2,
                                       "policy": "fixed"})
    assert m["num_draft_tokens"] > NUM // 4 and m["num_accepted_tokens"] > 0, m
    assert chi_square_pvalue(counts, exact_law) > ALPHA


def test_trees_are_refused(models):
    target, twin, _ = models
    with pytest.raises(ValueError, match="chains only"):
        Generator(str(target), speculative={"method": "draft_model", "model": str(twin), "num_speculative_tokens": 3,
                                            "token_tree": [[0], [1], [0, 0]]})
