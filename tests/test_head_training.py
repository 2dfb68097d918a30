"""train-heads: self-distillation on a tiny target makes an MLP speculator accept more than an
untrained one, through the engine; training resumes exactly; the CLI writes a loadable head."""
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from specinfer import Generator, SamplingParams
from specinfer.training.distill_data import DistillSequence, build_sequences
from specinfer.training.head_training import WARMUP_STEPS, MLPSpeculatorTrainer, TrainConfig, learning_rate, train


@pytest.fixture(scope="module")
def setup(tiny_dir):
    target = tiny_dir("llama", False)[0]
    gen = Generator(str(target), max_model_len=256)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (8,), generator=g).tolist() for _ in range(80)]
    return target, gen, prompts, build_sequences(gen, prompts[:64], 48)


def _acceptance(target, head, prompts):
    gen = Generator(str(target), max_model_len=256, num_kv_blocks=128,
                    speculative={"method": "mlp_speculator", "model": str(head), "num_speculative_tokens": 4,
                                 "policy": "fixed"})  # every request drafts k: acceptance over all of them
    gen.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0), use_tqdm=False)
    return gen.spec_metrics()["acceptance_rate"]


def test_trained_head_accepts_more_than_untrained(setup, tmp_path):
    target, gen, prompts, seqs = setup
    untrained = tmp_path / "untrained"
    MLPSpeculatorTrainer(gen.engine.loaded, 4, seed=0, seqs=seqs).save(untrained, gen.engine.loaded)
    report = train(gen.engine.loaded, seqs, tmp_path / "trained",
                   TrainConfig("mlp_speculator", steps=300), progress=False)  # a fixed step count: deterministic
    assert report["held_out"]["positions"] > 0  # (6 held-out sequences: too few to bound its value)
    before = _acceptance(target, untrained, prompts[64:])  # prompts not trained on
    after = _acceptance(target, tmp_path / "trained", prompts[64:])
    assert after > max(0.01, 5 * before), (before, after)  # measured: 0.0004 -> 0.025


def test_training_resumes_exactly(setup, tmp_path):
    _, gen, _, seqs = setup
    cfg = dict(method="mlp_speculator", batch_size=16, save_every=5, steps=12, lr_schedule="wsd")
    train(gen.engine.loaded, seqs, tmp_path / "once", TrainConfig(**cfg), progress=False)
    for i in range(3):  # interrupted after one step each time (a time limit of 0 s), then resumed
        report = train(gen.engine.loaded, seqs, tmp_path / "twice", TrainConfig(**cfg, max_seconds=0.0),
                       progress=False)
        assert report["steps"] == i + 1
    report = train(gen.engine.loaded, seqs, tmp_path / "twice", TrainConfig(**cfg), progress=False)
    assert report["steps"] == 12
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("once", "twice"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="other settings"):
        train(gen.engine.loaded, seqs, tmp_path / "twice", TrainConfig(**{**cfg, "batch_size": 8}), progress=False)
    with pytest.raises(ValueError, match="other settings"):  # wsd's rate ends at --steps: a run keeps them
        train(gen.engine.loaded, seqs, tmp_path / "twice", TrainConfig(**{**cfg, "steps": 20}), progress=False)


def test_invsqrt_training_extended_equals_one_asked_for_the_steps_at_once(setup, tmp_path):
    _, gen, _, seqs = setup
    cfg = dict(method="mlp_speculator", batch_size=16, save_every=5, lr_schedule="invsqrt")
    train(gen.engine.loaded, seqs, tmp_path / "once", TrainConfig(steps=12, **cfg), progress=False)
    train(gen.engine.loaded, seqs, tmp_path / "twice", TrainConfig(steps=7, **cfg), progress=False)
    report = train(gen.engine.loaded, seqs, tmp_path / "twice", TrainConfig(steps=12, **cfg), progress=False)
    assert report["steps"] == 12
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("once", "twice"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_learning_rate_schedules():
    wsd = TrainConfig("eagle", steps=1000, lr=1e-3)
    assert wsd.lr_schedule == "wsd"
    r = [learning_rate(wsd, s) for s in range(1000)]
    assert r[0] == pytest.approx(1e-3 / WARMUP_STEPS) and r[WARMUP_STEPS - 1] == pytest.approx(1e-3)
    assert all(x == pytest.approx(1e-3) for x in r[WARMUP_STEPS:701])  # stable
    assert r[850] == pytest.approx(0.5e-3) and r[999] == pytest.approx(1e-3 / 300)  # linear to zero at steps
    assert all(a > b for a, b in zip(r[700:], r[701:]))
    inv = [TrainConfig("eagle", steps=n, lr=1e-3, lr_schedule="invsqrt") for n in (1000, 5000)]
    assert [learning_rate(inv[0], s) for s in range(1000)] == [learning_rate(inv[1], s) for s in range(1000)]
    assert learning_rate(inv[0], 799) == pytest.approx(0.5e-3)  # sqrt(200 / 800)
    with pytest.raises(ValueError, match="lr_schedule"):
        TrainConfig("eagle", lr_schedule="cosine")
    assert TrainConfig("eagle").lr == 2e-3 and TrainConfig("medusa").lr == 3e-3  # the method's defaults
    assert TrainConfig("medusa").lr_schedule == TrainConfig("mlp_speculator").lr_schedule == "invsqrt"
    with pytest.raises(ValueError, match="lr must be a positive number"):
        TrainConfig("eagle", lr=0.0)


@pytest.mark.slow  # ~20 s: subprocess + model load; train() itself is covered above
def test_cli_train_heads_writes_a_loadable_head(setup, tmp_path):
    target = setup[0]
    proc = subprocess.run([sys.executable, "-m", "specinfer", "train-heads", str(target), "--method", "medusa",
                           "--out", str(tmp_path / "m"), "--prompts", "6", "--max-tokens", "24", "--steps", "5",
                           "--num-heads", "3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "held-out estimate" in proc.stderr and "train medusa" in proc.stderr  # summary and progress bar
    gen = Generator(str(target), speculative={"method": "medusa", "model": str(tmp_path / "m"),
                                              "num_speculative_tokens": 3})
    assert len(gen.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)) == 1


def _check_head_runs_greedy_exact(target, gen, prompts, method, head):
    """The trained head drives speculation and the greedy output equals the target's alone."""
    eng = Generator(str(target), max_model_len=256, num_kv_blocks=64,
                    speculative={"method": method, "model": str(head), "num_speculative_tokens": 3})
    want = gen.generate(prompts[64:70], SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    got = eng.generate(prompts[64:70], SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert eng.spec_metrics()["num_draft_tokens"] > 0


@pytest.mark.parametrize("draft_vocab", [8192, 96])  # 8192 >= the tiny vocabulary: no d2t written
def test_eagle_training_writes_a_head_the_engine_runs(setup, tmp_path, draft_vocab):
    target, gen, prompts, seqs = setup
    report = train(gen.engine.loaded, seqs[:16], tmp_path / "e",
                   TrainConfig("eagle", steps=6, save_every=3, draft_vocab_size=draft_vocab), progress=False)
    saved = load_file(str(tmp_path / "e" / "model.safetensors"))
    assert ("d2t" in saved) == (draft_vocab < 256)
    if draft_vocab < 256:
        assert len(saved["d2t"]) == draft_vocab
    assert report["steps"] == 6 and report["final_loss"] == report["final_loss"]  # not NaN
    assert report["held_out"]["positions"] > 0
    _check_head_runs_greedy_exact(target, gen, prompts, "eagle", tmp_path / "e")


def test_eagle3_training_writes_a_head_the_engine_runs(tiny_dir, tmp_path):
    """EAGLE-3: aux-layer states, truncated draft vocabulary with d2t, unrolled steps; the export
    loads, the engine's greedy output with it equals the target's, and training lowers the loss."""
    from specinfer.training.eagle3_training import training_aux_layers

    target = tiny_dir("llama", False, layers=4)[0]
    gen = Generator(str(target), max_model_len=256)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (8,), generator=g).tolist() for _ in range(40)]
    aux = training_aux_layers(gen.engine.loaded.config.num_layers)
    seqs = build_sequences(gen, prompts[:32], 32, aux)
    cfg = dict(steps=1, save_every=1, draft_vocab_size=96)
    first = train(gen.engine.loaded, seqs, tmp_path / "one", TrainConfig("eagle3", **cfg), progress=False)
    report = train(gen.engine.loaded, seqs, tmp_path / "e3", TrainConfig("eagle3", **{**cfg, "steps": 30}),
                   progress=False)
    assert report["final_loss"] < first["final_loss"], (first["final_loss"], report["final_loss"])
    assert report["held_out"]["positions"] > 0
    t = load_file(str(tmp_path / "e3" / "model.safetensors"))
    assert t["lm_head.weight"].shape[0] == 96 and t["d2t"].shape == (96,) and int(t["t2d"].sum()) == 96
    eng = Generator(str(target), max_model_len=256, num_kv_blocks=64,
                    speculative={"method": "eagle3", "model": str(tmp_path / "e3"), "num_speculative_tokens": 3})
    want = gen.generate(prompts[32:38], SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    got = eng.generate(prompts[32:38], SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert eng.spec_metrics()["num_draft_tokens"] > 0


def test_label_softmax_equals_full_softmax_restricted_to_the_labels(setup):
    """The training token loss: cross-entropy over the label vocabulary equals the full one after
    masking every other token's logit (computed independently), and -100 rows are ignored."""
    from specinfer.training.distill_data import LabelSoftmax, label_vocabulary

    _, gen, _, seqs = setup
    lm = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    soft = LabelSoftmax(lm, seqs)
    ids = label_vocabulary(seqs, 256)
    assert set(ids.tolist()) == {t for s in seqs for t in s.tokens[s.prompt_len:].tolist()}
    h = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    labels = torch.tensor([int(ids[0]), int(ids[-1]), -100, int(ids[3]), int(ids[1])])
    logits = h @ lm.T
    masked = torch.full_like(logits, float("-inf"))
    masked[:, ids] = logits[:, ids]
    keep = labels >= 0
    want = torch.nn.functional.cross_entropy(masked[keep], labels[keep])
    assert torch.allclose(soft.loss(h, labels), want, atol=1e-5)


def test_label_softmax_soft_loss_is_cross_entropy_against_the_targets_distribution(setup):
    """EAGLE's token loss: cross-entropy against the target's own next-token distribution (read off
    its states) over the label vocabulary, computed independently with masked full logits; it is
    smallest when the head's states equal the target's."""
    from specinfer.training.distill_data import LabelSoftmax, label_vocabulary

    _, gen, _, seqs = setup
    lm = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    soft = LabelSoftmax(lm, seqs)
    ids = label_vocabulary(seqs, 256)
    h = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    f = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))

    def masked(x):
        out = torch.full((len(x), 256), float("-inf"))
        out[:, ids] = (x @ lm.T)[:, ids]
        return out

    p = torch.softmax(masked(f), -1)
    logq = torch.log_softmax(masked(h), -1)[:, ids]
    want = -(p[:, ids] * logq).sum(-1).mean()
    assert torch.allclose(soft.soft_loss(h, f), want, atol=1e-5)
    assert soft.soft_loss(f, f) < soft.soft_loss(h, f)  # Gibbs: the target's own states score best


def test_training_prompts_leave_out_what_the_bench_measures():
    """train-heads never trains on the prompts the bench measures (the first of each task) nor on
    the standard-library modules those prompts are cut from."""
    import json
    import re

    from specinfer.prompt_sets import DATA_DIR
    from specinfer.training.distill_data import EVAL_PROMPTS_PER_TASK, training_texts

    texts = [t for t, _ in training_texts(10_000)]
    rows = [json.loads(x) for f in sorted(DATA_DIR.glob("*.jsonl")) for x in f.read_text().splitlines() if x]
    by_task = {}
    for r in rows:
        by_task.setdefault(r["task"], []).append(r)
    measured = [r for rs in by_task.values() for r in rs[:EVAL_PROMPTS_PER_TASK]]
    assert measured and not any(r["prompt"] in texts for r in measured)
    assert all(r["prompt"] in texts for rs in by_task.values() for r in rs[EVAL_PROMPTS_PER_TASK:])
    modules = {re.split(r"[. ]", r["source"][7:])[0] for r in rows if r.get("source", "").startswith("stdlib:")}
    import sysconfig
    from pathlib import Path

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for m in sorted(modules)[:5]:
        head = (stdlib / f"{m}.py").read_text(encoding="utf-8")[:600]
        assert not any(head in t for t in texts), m
    assert len(texts) > 500 and sum(c for _, c in training_texts(10_000)) > 0.7 * len(texts)


def test_task_shaped_prompts_have_each_bench_shape_and_leave_out_the_bench_modules():
    """Task-shaped prompts (the bench's formats on other modules) come after the others, interleaved
    by task, and hold no function or docstring of a module the bench prompts are cut from."""
    import sysconfig
    from pathlib import Path

    from specinfer.prompt_sets.build import docstrings_of, functions_of
    from specinfer.training.distill_data import held_out_modules, training_texts

    base = training_texts(1000)
    texts = training_texts(1000, task_shaped_per_task=40)
    assert texts[:1000] == base and len(texts) == 1000 + 4 * 40
    shaped = [t for t, chat in texts[1000:] if chat]
    assert len(shaped) == 160
    starts = ("Continue this Python function", "Summarize the following text", "Read the passage and answer")
    for s in starts:
        assert sum(t.startswith(s) for t in shaped) == 40
    assert sum(not t.startswith(starts) for t in shaped) == 40  # code edits
    assert shaped[0].startswith(starts[0])
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    held = held_out_modules()
    assert {"abc", "argparse", "heapq"} <= held
    for m in sorted(held):
        src = (stdlib / f"{m}.py").read_text(encoding="utf-8")
        pieces = [code for _, code in functions_of(m, src)] + list(docstrings_of(m, src))
        assert not any(p in t for p in pieces for t in shaped), m


@pytest.mark.parametrize("draft_vocab", [8192, 96])
def test_medusa_training_writes_a_head_the_engine_runs(setup, tmp_path, draft_vocab):
    """Medusa: the original layout on the target's lm_head, or (a truncated draft vocabulary)
    vLLM's layout with one shared head of the target's rows and token_map; greedy output exact."""
    target, gen, prompts, seqs = setup
    report = train(gen.engine.loaded, seqs, tmp_path / "m",
                   TrainConfig("medusa", steps=40, draft_vocab_size=draft_vocab), progress=False)
    assert report["held_out"]["positions"] > 0
    files = {p.name for p in (tmp_path / "m").iterdir()}
    if draft_vocab < 256:
        saved = load_file(str(tmp_path / "m" / "model.safetensors"))
        assert len(saved["token_map"]) == draft_vocab and saved["lm_heads.0.weight"].shape[0] == draft_vocab
    else:
        assert "medusa_lm_head.safetensors" in files
    _check_head_runs_greedy_exact(target, gen, prompts, "medusa", tmp_path / "m")


def test_bf16_training_lowers_the_loss_and_the_head_runs_greedy_exact(setup, tmp_path):
    """train_dtype="bfloat16": training under CPU autocast (fp32 master weights) lowers the held-out
    loss, the export is fp32 and drives exact greedy speculation; a bad dtype is refused."""
    target, gen, prompts, seqs = setup
    cfg = dict(steps=1, save_every=1, draft_vocab_size=96, train_dtype="bfloat16")
    first = train(gen.engine.loaded, seqs, tmp_path / "one", TrainConfig("eagle", **cfg), progress=False)
    report = train(gen.engine.loaded, seqs, tmp_path / "e", TrainConfig("eagle", **{**cfg, "steps": 40}),
                   progress=False)
    assert report["held_out_loss"] < first["held_out_loss"], (first["held_out_loss"], report["held_out_loss"])
    assert load_file(str(tmp_path / "e" / "model.safetensors"))["fc.weight"].dtype == torch.float32
    _check_head_runs_greedy_exact(target, gen, prompts, "eagle", tmp_path / "e")
    with pytest.raises(ValueError, match="train_dtype"):
        TrainConfig("eagle", train_dtype="float16")


def test_distillation_data_with_aux_states_serves_a_head_that_reads_none(setup, tmp_path):
    """cached_sequences: data built for EAGLE-3 (aux states) is reused by EAGLE-1 / Medusa / MLP
    (aux dropped), never the other way round, and never for another model or prompt count."""
    from specinfer.training.distill_data import cached_sequences

    _, _, _, seqs = setup
    with_aux = [DistillSequence(s.tokens, s.prompt_len, s.final, torch.zeros(len(s.tokens), 3)) for s in seqs[:3]]
    path, key = tmp_path / "distill_data.pt", {"model": "m", "prompts": 3, "max_tokens": 48, "aux": [0, 1, 2]}
    assert cached_sequences(path, key, lambda: with_aux) is with_aux
    built = []

    def build():
        built.append(1)
        return seqs[:3]

    reused = cached_sequences(path, {**key, "aux": []}, build)
    assert not built and [s.aux for s in reused] == [None] * 3
    assert all(torch.equal(a.final, b.final) for a, b in zip(reused, with_aux))
    cached_sequences(path, {**key, "aux": [], "prompts": 4}, build)
    assert built == [1]


def test_distillation_data_built_in_bf16_trains_a_head_for_the_float32_target(setup, tmp_path):
    """train_head(data_dtype="bfloat16"): the target builds the data in bf16 (its states near, not
    equal to, the float32 build of the same prompts), the cache key names the dtype (float32 data is
    never reused for it, nor it for float32), and the head, trained for the float32 target, drives
    exact greedy speculation there; another dtype is refused."""
    from specinfer.training.head_training import train_head

    target, gen, prompts, _ = setup
    cfg = TrainConfig("eagle", steps=3, save_every=3, draft_vocab_size=96)
    train_head(str(target), tmp_path / "f32", cfg, 12, 16, progress=False, data_dtype="float32")
    train_head(str(target), tmp_path / "bf16", cfg, 12, 16, progress=False, data_dtype="bfloat16")
    f32, bf16 = (torch.load(tmp_path / d / "distill_data.pt", weights_only=False) for d in ("f32", "bf16"))
    assert "dtype" not in f32["key"] and bf16["key"]["dtype"] == "bfloat16"
    a, b = f32["seqs"][0], bf16["seqs"][0]
    n = min(len(a["tokens"]), len(b["tokens"]))
    assert torch.equal(a["tokens"][:a["prompt_len"]], b["tokens"][:b["prompt_len"]])  # the same prompt
    err = (a["final"][:n] - b["final"][:n]).norm() / a["final"][:n].norm()
    assert 0 < err < 0.1, err  # built in bf16: close, not the float32 bits
    # the float32 data in bf16's place is rebuilt, not reused
    (tmp_path / "bf16" / "distill_data.pt").write_bytes((tmp_path / "f32" / "distill_data.pt").read_bytes())
    (tmp_path / "bf16" / "train_state.pt").unlink()
    train_head(str(target), tmp_path / "bf16", cfg, 12, 16, progress=False, data_dtype="bfloat16")
    assert torch.load(tmp_path / "bf16" / "distill_data.pt", weights_only=False)["key"]["dtype"] == "bfloat16"
    _check_head_runs_greedy_exact(target, gen, prompts, "eagle", tmp_path / "bf16")
    with pytest.raises(ValueError, match="data_dtype"):
        train_head(str(target), tmp_path / "x", cfg, 12, 16, progress=False, data_dtype="float16")


def test_packed_target_states_equal_one_forward_per_sequence(tiny_dir):
    """build_sequences packs several sequences into one forward: each sequence's states are those
    of HF transformers over it alone (final: the post-norm last hidden state; EAGLE-3's aux: the
    inputs of its aux layers)."""
    from transformers import AutoModelForCausalLM

    from specinfer.training.distill_data import packed_target_states
    from specinfer.training.eagle3_training import training_aux_layers

    target = tiny_dir("llama", False, layers=4)[0]
    engine = Generator(str(target), max_model_len=256).engine
    aux = training_aux_layers(engine.loaded.config.num_layers)
    g = torch.Generator().manual_seed(11)
    seqs = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 16, 17, 40, 1, 33)]
    packed = packed_target_states(engine.loaded.model, engine.runner.backend, seqs, aux)
    hf = AutoModelForCausalLM.from_pretrained(str(target), torch_dtype=torch.float32).eval()
    for s, (final, a) in zip(seqs, packed):
        with torch.no_grad():
            hs = hf(torch.tensor([s]), output_hidden_states=True).hidden_states  # embeddings, then each layer's output
        torch.testing.assert_close(final, hs[-1][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a, torch.cat([hs[i][0] for i in aux], -1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("right, starts", [(4, [5, 10, 15]), (0, list(range(5, 16))), (2, [5, 8, 11, 14])])
def test_acceptance_estimate_walk_starts_chains_where_the_engine_does(right, starts):
    """walk=True: the first chain right after the prompt's bonus token, each next one past the last
    chain's accepted drafts and its bonus token (a drafter right `right` times, then wrong)."""
    from specinfer.training.eagle_training import eagle_acceptance_estimate

    seq = DistillSequence(torch.arange(20), 5, torch.zeros(20, 4), None)
    seen = []

    class Drafter:
        def drafts(self, tokens, feats, k):  # history x_0..x_e with e = len(tokens)
            e = len(tokens)
            seen.append(e)
            return [e + 1 + i if i < right else -1 for i in range(k)]

    est = eagle_acceptance_estimate(Drafter(), [seq], 4, walk=True)
    assert seen == starts
    assert est["positions"] == len(starts)
    assert est["mean_acceptance_length"] == pytest.approx(1 + right)


def test_eagle_loss_knobs(setup, monkeypatch):
    """The ablation knobs of teacher-forced EAGLE training: prompt weighting at 1 - eps is the plain
    loss; a token-loss stride or input noise changes the loss, deterministically per batch."""
    from specinfer.training import eagle_training
    from specinfer.training.head_training import _dense_lm_head

    target, gen, _, seqs = setup
    trainer = eagle_training.EagleTrainer(gen.engine.loaded, 4, 0, _dense_lm_head(gen.engine.loaded), seqs)
    with torch.no_grad():  # a trained-looking head: the random init's o/down are zero
        trainer.params["o"].normal_(0, 0.05)
        trainer.params["down"].normal_(0, 0.05)
    batch = seqs[:4]
    plain = trainer.loss_on(batch)
    monkeypatch.setattr(eagle_training, "PROMPT_WEIGHT", 1 - 1e-9)
    torch.testing.assert_close(trainer.loss_on(batch), plain)
    monkeypatch.setattr(eagle_training, "PROMPT_WEIGHT", 1.0)
    for knob, value in (("TOKEN_LOSS_STRIDE", 3), ("FEATURE_NOISE", 0.3)):
        monkeypatch.setattr(eagle_training, knob, value)
        a, b = trainer.loss_on(batch), trainer.loss_on(batch)
        assert torch.isfinite(a) and a == b and a != plain, knob
        monkeypatch.undo()


def test_self_instruct_questions_are_the_targets_own_user_messages(tmp_path):
    """Magpie-style questions: the target continues its chat template's user-turn opening; each kept
    question ended with the target's end token, is distinct, and the same seed gives the same ones."""
    import json

    from tiny_models import build_tiny_model

    from specinfer.training.distill_data import self_instruct_questions, user_turn_prefix

    build_tiny_model(tmp_path, "llama", seed=4, vocab=16)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for m in messages %}t5 {{ m['content'] }} t2 {% endfor %}"
                            "{% if add_generation_prompt %}t6 {% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    gen = Generator(str(tmp_path), max_model_len=128)
    assert user_turn_prefix(gen.engine.loaded) == [5]
    a = self_instruct_questions(gen, 6, seed=1, min_tokens=2)
    assert a == self_instruct_questions(gen, 6, seed=1, min_tokens=2)
    assert len(a) == 6 and len(set(a)) == 6
    tok = gen.engine.loaded.tokenizer
    for q in a:
        ids = tok.encode(q, add_special_tokens=False).ids
        assert len(ids) >= 2 and 2 not in ids  # the end token closed the message and is not part of it
    assert a != self_instruct_questions(gen, 6, seed=2, min_tokens=2)
    with pytest.raises(ValueError, match="only 0 of 3"):
        self_instruct_questions(gen, 3, seed=1, min_tokens=1000)
