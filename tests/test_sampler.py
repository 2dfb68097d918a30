"""Tests of SamplingMetadata, the logits processor and the Sampler (CPU, fp32/fp64)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specinfer.sample.metadata import RowParameterError
from specinfer.sample import (RandomStreams, Sampler, SamplingMetadata, apply_min_p, apply_top_k_top_p,
                              probs_from_logits, process_logits)
from stats import ALPHA, chi_square_pvalue

NUM_SAMPLES = 120_000
NEG_INF = float("-inf")


def kept(logits: torch.Tensor) -> list[list[int]]:  # [L, V] -> surviving token ids per row
    return [torch.isfinite(row).nonzero().squeeze(1).tolist() for row in logits]


PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)


def streams(n: int, seed: int = 0, positions=None) -> RandomStreams:
    """n rows with distinct seeds derived from ``seed``."""
    seeds = np.arange(n, dtype=np.uint64) + np.uint64(seed) * np.uint64(1_000_003)
    return RandomStreams.build(seeds, np.zeros(n, np.int64) if positions is None else positions)


# --- metadata -----------------------------------------------------------------------------

def test_metadata_flags():
    meta = SamplingMetadata.build([0.0, 1.0, 0.5], top_k=[5, 0, -1], top_p=[0.5, 1.0, 1.0],
                                  min_p=[0.0, 0.0, 0.1])
    assert meta.is_greedy.tolist() == [True, False, False]
    assert (meta.all_greedy, meta.all_random) == (False, False)
    # top-k and top-p are set only on the greedy row, where they cannot matter
    assert (meta.no_top_k, meta.no_top_p, meta.no_min_p) == (True, True, False)
    assert SamplingMetadata.build([0.0, 0.0]).all_greedy
    assert SamplingMetadata.build([1.0, 0.3]).all_random


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=[1.0, -0.5]), "temperature"),
    (dict(temperature=[float("nan")]), "temperature"),
    (dict(temperature=[1.0], top_k=[-2]), "top_k"),
    (dict(temperature=[1.0], top_p=[0.0]), "top_p"),
    (dict(temperature=[1.0], top_p=[1.5]), "top_p"),
    (dict(temperature=[1.0], min_p=[2.0]), "min_p"),
    (dict(temperature=[1.0, 1.0], top_k=[1]), "top_k"),
    (dict(temperature=[1.0], streams=RandomStreams.build([1, 2], [0, 0])), "streams"),
])
def test_metadata_bad_input_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingMetadata.build(**kwargs)


def test_metadata_built_on_the_host_for_another_device_equals_build():
    """For a device other than the CPU the rows are validated and flagged on the host and copied
    asynchronously (a check on the device would wait for every kernel queued on its stream);
    take() and expand() of such metadata select on the host too. The CPU stands in for the device."""
    rows = dict(top_k=[0, 3, -1, 0], top_p=[1.0, 0.9, 1.0, 0.5], min_p=[0.0, 0.0, 0.1, 0.0])
    streams = RandomStreams.build([5, 9, 2, 7], [4, 10, 0, 3])
    plain = SamplingMetadata.build([0.0, 0.7, 1.2, 0.0], streams=streams, **rows)
    host = SamplingMetadata.built_on_host([0.0, 0.7, 1.2, 0.0], streams=streams, device="cpu", **rows)
    assert plain.host is None and host.host is not None

    def same(a, b):
        for f in ("temperature", "top_k", "top_p", "min_p"):
            assert getattr(a, f).tolist() == getattr(b, f).tolist()
        assert (a.all_greedy, a.all_random, a.no_top_k, a.no_top_p, a.no_min_p) == \
               (b.all_greedy, b.all_random, b.no_top_k, b.no_top_p, b.no_min_p)
        assert a.streams.positions.tolist() == b.streams.positions.tolist()

    same(host, plain)
    same(host.take([2, 0]), plain.take([2, 0]))
    same(host.take([0, 3]), plain.take([0, 3]))  # all greedy
    assert host.take([2, 0]).host is not None
    same(host.expand([1, 3, 0, 2]), plain.expand([1, 3, 0, 2]))
    with pytest.raises(RowParameterError, match="top_p"):
        SamplingMetadata.built_on_host([1.0], top_p=[1.5], device="cpu")


def test_metadata_expand_repeats_rows_and_advances_positions():
    meta = SamplingMetadata.build([0.0, 0.7], top_k=[0, 3], streams=RandomStreams.build([5, 9], [4, 10]))
    wide = meta.expand([1, 3])
    assert wide.temperature.tolist() == pytest.approx([0.0, 0.7, 0.7, 0.7])
    assert wide.top_k.tolist() == [0, 3, 3, 3]
    assert wide.streams.seeds.tolist() == [5, 9, 9, 9]
    assert wide.streams.positions.tolist() == [4, 10, 11, 12]  # row j decides position P + j


# --- logits processing, exact on hand-built rows ----------------------------------------------

@pytest.mark.parametrize("k,expected", [
    (2, [1, 3]), (3, [1, 2, 3]), (1, [1, 3]),  # ties with the k-th value are kept
    (0, [0, 1, 2, 3, 4]), (-1, [0, 1, 2, 3, 4]), (10, [0, 1, 2, 3, 4]),
])
def test_top_k_mask(k, expected):
    logits = torch.tensor([[1.0, 5.0, 3.0, 5.0, 2.0]])
    out = apply_top_k_top_p(logits, torch.tensor([k]), None)
    assert kept(out) == [expected]
    assert torch.equal(out[torch.isfinite(out)], logits[0, expected])


@pytest.mark.parametrize("top_p,expected", [
    (0.45, [0]), (0.6, [0, 1]), (0.9, [0, 1, 2]), (1.0, [0, 1, 2, 3]),
])
def test_top_p_mask(top_p, expected):
    logits = PROBS.log()[[2, 0, 3, 1]].unsqueeze(0)  # shuffled: token ids 1, 3, 0, 2 by prob
    order = [1, 3, 0, 2]
    out = apply_top_k_top_p(logits, None, torch.tensor([top_p], dtype=torch.float64))
    assert kept(out) == [sorted(order[i] for i in expected)]


@pytest.mark.parametrize("min_p,expected", [(0.05, [0, 1, 2, 3]), (0.35, [0, 1]), (0.7, [0])])
def test_min_p_mask(min_p, expected):
    out = apply_min_p(PROBS.log().unsqueeze(0), torch.tensor([min_p], dtype=torch.float64))
    assert kept(out) == [expected]


def test_processing_applies_each_rows_own_parameters():
    logits = PROBS.log().expand(5, -1).clone()
    meta = SamplingMetadata.build([1.0, 1.0, 1.0, 1.0, 0.0], top_k=[1, 0, 0, 0, 0],
                                  top_p=[1.0, 0.6, 1.0, 1.0, 1.0], min_p=[0.0, 0.0, 0.7, 0.0, 0.0])
    assert kept(process_logits(logits, meta)) == [[0], [0, 1], [0], [0, 1, 2, 3], [0, 1, 2, 3]]
    # a greedy row is unscaled (only its argmax matters)
    torch.testing.assert_close(process_logits(logits, meta)[4], logits[4])


def test_temperature_comes_before_min_p():
    """T=2 flattens [.5,.3,.15,.05] to ~[.379,.294,.208,.120]: min_p .5 keeps 3, not 2."""
    meta = SamplingMetadata.build([2.0], min_p=[0.5])
    probs = probs_from_logits(PROBS.log().unsqueeze(0), meta)[0]
    expected = PROBS.sqrt() * torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(probs, expected / expected.sum())


def test_probs_from_logits_rows():
    logits = torch.tensor([[0.1, 2.0, -1.0], [0.1, 2.0, -1.0], [3.0, 0.0, 0.0]],
                          dtype=torch.float64)
    meta = SamplingMetadata.build([0.0, 0.5, 1.0], top_k=[0, 0, 2])
    probs = probs_from_logits(logits, meta)
    assert probs[0].tolist() == [0.0, 1.0, 0.0]
    torch.testing.assert_close(probs[1], torch.softmax(logits[1] / 0.5, 0))
    assert probs[2, 1] == probs[2, 2] > 0  # top-2 with a tie for 2nd place keeps both
    torch.testing.assert_close(probs.sum(1), torch.ones(3, dtype=torch.float64))


# --- Sampler --------------------------------------------------------------------------------

def test_greedy_rows_are_argmax():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0))
    temperature = [0.0 if i % 2 == 0 else 1.0 for i in range(64)]
    out = Sampler()(logits, SamplingMetadata.build(temperature, streams=streams(64, 1)))
    assert torch.equal(out.token_ids[::2], logits.argmax(-1)[::2])
    all_greedy = Sampler()(logits, SamplingMetadata.build([0.0] * 64))
    assert torch.equal(all_greedy.token_ids, logits.argmax(-1))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sampling_matches_softmax(temperature):
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5], dtype=torch.float64)
    meta = SamplingMetadata.build([temperature] * NUM_SAMPLES, streams=streams(NUM_SAMPLES, 3))
    out = Sampler()(logits.expand(NUM_SAMPLES, -1), meta)
    counts = torch.bincount(out.token_ids, minlength=6)
    assert chi_square_pvalue(counts, torch.softmax(logits / temperature, 0)) > ALPHA
    # the same test is not blind: a wrong temperature fails it
    assert chi_square_pvalue(counts, torch.softmax(logits / (temperature * 1.1), 0)) < ALPHA


def test_filtered_sampling_matches_renormalized_distribution():
    logits = PROBS.log()
    meta = SamplingMetadata.build([1.0] * NUM_SAMPLES, top_k=[3] * NUM_SAMPLES,
                                  top_p=[0.7] * NUM_SAMPLES, streams=streams(NUM_SAMPLES, 4))
    out = Sampler()(logits.expand(NUM_SAMPLES, -1), meta)
    expected = torch.tensor([0.5, 0.3, 0.0, 0.0], dtype=torch.float64) / 0.8
    assert chi_square_pvalue(torch.bincount(out.token_ids, minlength=4), expected) > ALPHA


def test_one_stream_over_positions_matches_the_distribution():
    """One seed, successive output positions (a request decoding): the draws are i.i.d."""
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5], dtype=torch.float64)
    n = 60_000
    meta = SamplingMetadata.build([1.0] * n, streams=RandomStreams.build([12345] * n, np.arange(n)))
    counts = torch.bincount(Sampler()(logits.expand(n, -1), meta).token_ids, minlength=6)
    assert chi_square_pvalue(counts, torch.softmax(logits, 0)) > ALPHA


def test_float32_sampling_matches_softmax():
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5], dtype=torch.float32)
    meta = SamplingMetadata.build([0.8] * NUM_SAMPLES, streams=streams(NUM_SAMPLES, 8))
    counts = torch.bincount(Sampler()(logits.expand(NUM_SAMPLES, -1), meta).token_ids, minlength=6)
    assert chi_square_pvalue(counts, torch.softmax(logits.double() / 0.8, 0)) > ALPHA


def test_seeded_row_same_alone_and_in_batch():
    vocab = 1000
    g = torch.Generator().manual_seed(0)
    row = torch.randn(1, vocab, generator=g)
    alone = [Sampler()(row, SamplingMetadata.build([0.9], top_p=[0.95],
                                                  streams=RandomStreams.build([77], [step])))
             .token_ids[0].item() for step in range(8)]
    for position in (0, 2, 5):
        tokens = []
        for step in range(8):
            others = torch.randn(6, vocab, generator=g)
            logits = torch.cat([others[:position], row, others[position:]])
            seeds = [step, 3, 4, 5, 6, 7]
            seeds.insert(position, 77)
            positions = [0, 1, 2, 3, 4, 5]
            positions.insert(position, step)
            temps = [1.0, 0.0, 0.7, 1.3, 1.0, 0.0]
            temps.insert(position, 0.9)
            top_p = [1.0] * 7
            top_p[position] = 0.95
            meta = SamplingMetadata.build(temps, top_p=top_p, streams=RandomStreams.build(seeds, positions))
            tokens.append(Sampler()(logits, meta).token_ids[position].item())
        assert tokens == alone
    assert len(set(alone)) > 1  # the stream moves: the comparison is not trivially equal


def test_sampling_without_streams_is_refused():
    with pytest.raises(ValueError, match="streams"):
        Sampler()(torch.zeros(2, 4), SamplingMetadata.build([1.0, 0.0]))


def test_inverse_cdf_never_picks_a_zero_weight():
    from specinfer.sample import sample_from_weights
    w = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]], dtype=torch.float32).expand(5, -1)
    u = torch.tensor([1e-12, 0.5 - 1e-12, 0.5, 0.5 + 1e-12, 1 - 1e-12], dtype=torch.float64)
    assert sample_from_weights(w, u).tolist() == [1, 1, 3, 3, 3]


def test_logprobs_are_raw_log_softmax():
    """compute_logprobs is what the engine reports (StepSampler._logprobs calls it)."""
    from specinfer.sample import compute_logprobs

    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(5))
    meta = SamplingMetadata.build([0.0, 0.5, 1.0, 2.0, 1.0], top_k=[0, 3, 0, 0, 2], streams=streams(5, 6))
    tokens = Sampler()(logits, meta).token_ids
    lp = compute_logprobs(logits, tokens, 4)
    raw = torch.log_softmax(logits, -1)
    assert lp.token_ids.shape == (5, 5) and lp.logprobs.shape == (5, 5)
    assert torch.equal(lp.token_ids[:, 0], tokens)
    torch.testing.assert_close(lp.logprobs, raw.gather(1, lp.token_ids))
    assert torch.equal(lp.token_ids[:, 1:], raw.topk(4, -1).indices)
    expected_rank = (raw > raw.gather(1, tokens[:, None])).sum(1) + 1
    assert torch.equal(lp.sampled_token_ranks, expected_rank)
    assert lp.sampled_token_ranks[0] == 1  # greedy row samples the top token
    entries = lp.entries(2)
    for j, e in enumerate(entries):
        top2 = raw[j].topk(2).indices.tolist()
        assert set(e) == {int(tokens[j]), *top2}
        assert all(abs(e[t] - raw[j, t].item()) < 1e-6 for t in e)
    assert compute_logprobs(logits, tokens, 0).entries(0) == [{int(t): raw[j, t].item()}
                                                              for j, t in enumerate(tokens)]


def test_sampler_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(3, 4), SamplingMetadata.build([1.0, 1.0]))
