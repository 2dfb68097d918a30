"""The engine-level distribution harness shared by the distribution tests: a tiny-vocabulary
target (V = 8) and a perturbed draft, the exact joint law of the first three output tokens of a
fixed prompt (computed with transformers, the independent reference), and the sampled counts of
those outcomes through the whole engine. Fixtures `law_models` and `exact_law` live in conftest."""
from __future__ import annotations

import torch

from specinfer import Generator, SamplingParams

VOCAB = 8
PROMPT = [3, 4, 5, 3, 4]  # the n-gram proposer finds "3 4" earlier and proposes "5 3"
NUM = 24_000
N_CHECK = 3


def build_law_models(tmp_path_factory):
    """(target_dir, draft_dir, target transformers model)."""
    from tiny_models import build_tiny_model

    target_dir = tmp_path_factory.mktemp("v8_target")
    target = build_tiny_model(target_dir, "llama", vocab=VOCAB, scale=2.0, seed=3)
    draft_dir = tmp_path_factory.mktemp("v8_draft")
    build_tiny_model(draft_dir, "llama", vocab=VOCAB, base=target_dir, perturb=0.15)
    return target_dir, draft_dir, target


def exact_law_of(model, adjust=None) -> torch.Tensor:
    """P(t0, t1, t2 | PROMPT) at temperature 1 from the transformers model, float64 [V ** 3].
    `adjust(logits [V], prompt, output) -> logits` rewrites each row first (penalties by hand)."""
    model = model.double()
    with torch.no_grad():
        def next_probs(prefix):  # [B, len] -> [B, V]
            logits = model(torch.tensor(prefix)).logits[:, -1]
            if adjust is not None:
                logits = torch.stack([adjust(row, PROMPT, p[len(PROMPT):]) for row, p in zip(logits, prefix)])
            return torch.softmax(logits, -1)

        p0 = next_probs([PROMPT])[0]
        p1 = next_probs([PROMPT + [a] for a in range(VOCAB)])  # [V, V]
        p2 = next_probs([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)]).reshape(VOCAB, VOCAB, VOCAB)
    return (p0[:, None, None] * p1[:, :, None] * p2).reshape(-1)


def sample_counts(target, spec, **params) -> tuple[torch.Tensor, dict]:
    """Counts of the (t0, t1, t2) outcomes over NUM sampled requests, and the speculation metrics.
    `params`: extra SamplingParams fields (penalties, logit_bias, ...)."""
    gen = Generator(str(target), block_size=4, max_num_seqs=1024, max_num_batched_tokens=8192,
                    max_model_len=32, speculative=spec, seed=7)
    params = SamplingParams(max_tokens=N_CHECK + 1, temperature=1.0, ignore_eos=True, **params)
    outs = gen.generate([PROMPT] * NUM, params, use_tqdm=False)
    codes = torch.tensor([(o.token_ids[0] * VOCAB + o.token_ids[1]) * VOCAB + o.token_ids[2] for o in outs])
    return torch.bincount(codes, minlength=VOCAB ** N_CHECK), gen.spec_metrics()
