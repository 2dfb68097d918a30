"""Counter-based random streams: uniform, independent across positions, seeds and purposes,
and computed on the device bit for bit as the numpy reference."""
from __future__ import annotations

import numpy as np
import torch

from specinfer.sample.random_streams import (ACCEPT, DRAFT, SAMPLE, RandomStreams, counter_uniform,
                                             counter_uniform_torch)


def _chi2_uniform(u: np.ndarray, bins: int = 64) -> float:
    counts = np.bincount(np.minimum((u * bins).astype(np.int64), bins - 1), minlength=bins)
    exp = len(u) / bins
    stat = ((counts - exp) ** 2 / exp).sum()
    df = torch.tensor(float(bins - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, torch.tensor(stat / 2, dtype=torch.float64)))


def test_torch_equals_numpy_bit_for_bit():
    rng = np.random.default_rng(0)
    seeds = rng.integers(0, 2**64, size=500, dtype=np.uint64)
    seeds[:2] = [0, 2**64 - 1]
    pos = rng.integers(0, 2**40, size=(500, 5)).astype(np.int64)
    for purpose in (SAMPLE, ACCEPT, DRAFT):
        want = counter_uniform(seeds, pos, purpose)
        got = counter_uniform_torch(torch.from_numpy(seeds.view(np.int64)), torch.from_numpy(pos), purpose)
        assert got.dtype == torch.float64 and np.array_equal(got.numpy(), want)
    st = RandomStreams.build(seeds, pos[:, 0])
    assert np.array_equal(st.uniform(ACCEPT, 5).numpy(),
                          counter_uniform(seeds, pos[:, :1] + np.arange(5), ACCEPT))


def test_uniform_along_positions_seeds_and_purposes():
    n = 200_000
    along_positions = counter_uniform(np.full(1, 42, np.uint64), np.arange(n)[None, :], SAMPLE)[0]
    across_seeds = counter_uniform(np.arange(n, dtype=np.uint64), np.zeros(n, np.int64), SAMPLE)
    for u in (along_positions, across_seeds):
        assert 0.0 < u.min() and u.max() < 1.0
        assert _chi2_uniform(u) > 1e-3
    # purposes and neighbouring positions are uncorrelated
    a = counter_uniform(np.arange(n, dtype=np.uint64), np.zeros(n, np.int64), SAMPLE)
    b = counter_uniform(np.arange(n, dtype=np.uint64), np.zeros(n, np.int64), ACCEPT)
    c = counter_uniform(np.arange(n, dtype=np.uint64), np.ones(n, np.int64), SAMPLE)
    for x in (b, c):
        assert abs(np.corrcoef(a, x)[0, 1]) < 0.01
    # pairs of successive draws fill the unit square evenly (no lattice structure)
    pairs = np.minimum((along_positions[:-1] * 8).astype(int) * 8 + (along_positions[1:] * 8).astype(int), 63)
    assert _chi2_uniform((pairs + 0.5) / 64) > 1e-3


def test_a_draw_depends_only_on_its_own_key():
    st = RandomStreams.build([7, 8, 9], [3, 0, 5])
    alone = RandomStreams.build([8], [0]).uniform(DRAFT, 4)
    assert torch.equal(st.uniform(DRAFT, 4)[1:2], alone)
    assert torch.equal(st.take([1]).uniform(DRAFT, 4), alone)
    wide = st.expand([1, 3, 2])
    assert wide.positions.tolist() == [3, 0, 1, 2, 5, 6]
    assert torch.equal(wide.uniform(SAMPLE)[2, 0], st.uniform(SAMPLE, 3)[1, 1])
