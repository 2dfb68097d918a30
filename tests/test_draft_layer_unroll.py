"""The unrolled draft layer that EAGLE trainers train ("training-time test"): step s at pair i
equals the layer run densely over the pairs the engine's draft KV holds when it drafts a chain (the
history's true pairs up to i, then the chain's own pairs), for EAGLE-1 and EAGLE-3 alike; under bf16
autocast it stays close to fp32 and training lowers the loss."""
import types

import pytest
import torch

from specinfer.models.config import ModelConfig
from specinfer.training.distill_data import DistillSequence
from specinfer.training.draft_layer_unroll import chain_mask
from specinfer.training.eagle3_training import Eagle3Trainer
from specinfer.training.eagle_training import EagleTrainer

H, V, T = 32, 64, 12


def _target():
    cfg = ModelConfig("llama", V, H, 48, 6, 4, 2, 8, 1e-5, 10000.0, 128, tie_word_embeddings=True)
    emb = torch.randn(V, H, generator=torch.Generator().manual_seed(1))
    return types.SimpleNamespace(config=cfg, model=types.SimpleNamespace(embed_tokens=emb,
                                                                         norm=torch.ones(H)))


def _seqs(n=6, aux=False):
    g = torch.Generator().manual_seed(2)
    return [DistillSequence(torch.randint(0, V, (T + 4,), generator=g), 4, torch.randn(T + 4, H, generator=g),
                            torch.randn(T + 4, 3 * H, generator=g) if aux else None) for _ in range(n)]


def _randomize(trainer):  # o_proj / down_proj start at zero: give every weight a value, so attention counts
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in trainer.params.values():
            p.add_(0.3 * torch.randn(p.shape, generator=g))


def _trainer(kind):
    """A trainer of `kind` with random weights, its sequences, and step 1's input at seqs[0]'s pairs."""
    target = _target()
    seqs = _seqs(aux=kind == "eagle3")
    if kind == "eagle":
        tr = EagleTrainer(target, 3, 0, target.model.embed_tokens, seqs)
        first = seqs[0].final[None, :T]
    else:
        tr = Eagle3Trainer(target, seqs, 0, V, target.model.embed_tokens)
        first = torch.nn.functional.linear(seqs[0].aux[None, :T], tr.params["fc"])
    _randomize(tr)
    return tr, seqs, first


def test_chain_mask():
    m = chain_mask(3, 2)
    assert m.shape == (3, 9)
    assert m[:, :3].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert m[:, 3:6].tolist() == m[:, 6:].tolist() == torch.eye(3, dtype=torch.bool).tolist()


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_unrolled_steps_equal_the_chain_recomputed_densely(kind):
    tr, seqs, first = _trainer(kind)
    run = tr.unroll
    steps = 3
    tokens = seqs[0].tokens[None, 1:T + steps]  # x_{i+1} for pair i, then the tokens that follow
    with torch.no_grad():
        outs = run(tokens, first, steps)
        for i in (0, 4, T - 1):
            # the dense chain at pair i: true pairs 0..i, then (x_{i+1+s}, the chain's step s-1 output at i)
            toks, feats = tokens[:, :i + 1], first[:, :i + 1]
            for s in range(1, steps):
                toks = torch.cat([toks, tokens[:, i + s:i + s + 1]], 1)
                feats = torch.cat([feats, outs[s - 1][:, i:i + 1]], 1)
                dense = run(toks, feats, 1)[0][:, -1]
                assert torch.allclose(dense, outs[s][:, i], atol=1e-4), (kind, i, s)
            assert torch.allclose(run(tokens[:, :i + 1], first[:, :i + 1], 1)[0][:, -1], outs[0][:, i], atol=1e-4)


def test_eagle_ttt_steps_change_the_loss_and_one_step_is_teacher_forced():
    target, seqs = _target(), _seqs()
    one = EagleTrainer(target, 3, 0, target.model.embed_tokens, seqs, ttt_steps=1)
    three = EagleTrainer(target, 3, 0, target.model.embed_tokens, seqs, ttt_steps=3)
    _randomize(one)
    _randomize(three)
    with torch.no_grad():
        l1, l3 = float(one.loss_on(seqs[:2])), float(three.loss_on(seqs[:2]))
    assert l3 > l1 > 0  # the later steps add their (weighted) losses


def test_bf16_autocast_loss_is_close_to_fp32_and_has_gradients():
    target, seqs = _target(), _seqs()
    tr = EagleTrainer(target, 3, 0, target.model.embed_tokens, seqs)
    _randomize(tr)
    full = tr.loss_on(seqs[:3])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = tr.loss_on(seqs[:3])
    assert half.dtype == torch.float32
    assert abs(float(half.detach()) - float(full.detach())) < 0.05 * float(full.detach())
    half.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in tr.params.values())


def test_eagle_trainer_reads_back_its_export(tmp_path):
    target, seqs = _target(), _seqs()
    tr = EagleTrainer(target, 3, 0, target.model.embed_tokens, seqs, draft_vocab_size=40)
    _randomize(tr)
    tr.save(tmp_path, target)
    back = EagleTrainer(target, 3, 1, target.model.embed_tokens, seqs)  # another seed, no draft vocabulary
    back.load_export(tmp_path)
    assert all(torch.equal(tr.params[k], back.params[k]) for k in tr.params)
    assert torch.equal(back.draft_ids, tr.draft_ids)
    toks, feats = seqs[1].tokens[1:9], seqs[1].final[:8]
    assert back.drafts(toks, feats, 3) == tr.drafts(toks, feats, 3)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_later_steps_at_a_subset_of_pairs_equal_the_full_unroll_there(kind):
    tr, seqs, first = _trainer(kind)
    tokens = seqs[0].tokens[None, 1:T + 3]
    pairs = torch.tensor([1, 4, 7, 11])
    with torch.no_grad():
        full, part = tr.unroll(tokens, first, 3), tr.unroll(tokens, first, 3, pairs)
    assert part[0].shape == full[0].shape and torch.allclose(part[0], full[0])
    for s in (1, 2):
        assert part[s].shape == (1, 4, H)
        assert torch.allclose(part[s], full[s][:, pairs], atol=1e-5), s


def test_packed_sequences_equal_the_padded_batch_at_real_positions_and_the_loss_uses_them():
    """Training's step 1 packs sequences end to end (no padding computed): each sequence's outputs
    equal the right-padded batch's at its real positions, and loss_on is the EAGLE loss over them."""
    target = _target()
    g = torch.Generator().manual_seed(4)
    seqs = [DistillSequence(torch.randint(0, V, (n,), generator=g), 3, torch.randn(n, H, generator=g), None)
            for n in (9, 16, 5, 12)]
    tr = EagleTrainer(target, 3, 0, target.model.embed_tokens, seqs)
    _randomize(tr)
    lengths = [len(s.tokens) - 1 for s in seqs]
    T_ = max(lengths)
    tokens = torch.zeros(len(seqs), T_, dtype=torch.int64)
    feats = torch.zeros(len(seqs), T_, H)
    for b, s in enumerate(seqs):
        tokens[b, :lengths[b]], feats[b, :lengths[b]] = s.tokens[1:], s.final[:-1]
    with torch.no_grad():
        padded = tr.unroll(tokens, feats, 1)[0]
        packed = tr.packed(torch.cat([s.tokens[1:] for s in seqs]), torch.cat([s.final[:-1] for s in seqs]), lengths)
        real = torch.cat([padded[b, :n] for b, n in enumerate(lengths)])
        assert packed.shape == real.shape and torch.allclose(packed, real, rtol=1e-4, atol=1e-4)
        # pair i predicts f_{i+1}, for every pair but each sequence's last
        h = torch.cat([padded[b, :n - 1] for b, n in enumerate(lengths)])
        nxt = torch.cat([s.final[1:-1] for s in seqs])
        from specinfer.training import eagle_training
        want = torch.nn.functional.smooth_l1_loss(h, nxt) + eagle_training.CLS_WEIGHT * tr.label_softmax.soft_loss(h, nxt)
        assert torch.allclose(tr.loss_on(seqs), want, rtol=1e-5, atol=1e-5)
