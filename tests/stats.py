"""The one statistics harness of the suite: Pearson's chi-square goodness of fit, as DESIGN §7
asks (small vocabularies, ~1e5 samples, alpha = 1e-3). Every distribution test and its negative
controls use this function, so they share one small-cell rule."""
from __future__ import annotations

import torch

ALPHA = 1e-3


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of ``counts`` [C] against ``probs`` [C] (sums to 1).

    A count in a cell of probability 0 gives 0 (an impossible outcome was produced). Cells with an
    expected count below 5 are pooled into one (dropped if that pool expects nothing), so the
    chi-square approximation holds; degrees of freedom = cells - 1."""
    counts, probs = counts.double(), probs.double()
    expected = probs * counts.sum()
    impossible = expected <= 0
    if counts[impossible].sum() > 0:
        return 0.0
    small = (expected < 5) & ~impossible
    obs = torch.cat([counts[~impossible & ~small], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[~impossible & ~small], expected[small].sum().reshape(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor(float(obs.numel() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))
