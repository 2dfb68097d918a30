"""Sampling and verification: turn logits rows into tokens.

- :class:`SamplingMetadata`: per-row temperature / top-k / top-p / min-p / random streams.
- :class:`RandomStreams`: counter-based draws keyed on (seed, output position, purpose).
- :func:`probs_from_logits`: the processed distribution (shared by target and draft).
- :class:`Sampler`: one token per row.
- :func:`compute_logprobs`: raw logprobs of emitted tokens (the engine's one implementation).
- :func:`rejection_sample`: lossless verification of drafts.
- :func:`typical_acceptance_sample`: Medusa-style verification; NOT distribution-preserving.
- :func:`tree_rejection_sample`: lossless verification of token trees (SpecInfer MSS; greedy walk).
- :func:`tree_typical_acceptance_sample`: Medusa-style typical acceptance over trees; NOT lossless.
"""
from .logits_processor import (apply_min_p, apply_temperature, apply_top_k_top_p,
                               probs_from_logits, process_logits)
from .metadata import GREEDY_TEMPERATURE, SamplingMetadata
from .random_streams import RandomStreams, sample_from_weights
from .rejection_sampler import rejection_sample
from .logprobs import LogprobsTensors, compute_logprobs
from .sampler import Sampler, SamplerOutput
from .typical_acceptance import typical_acceptance_sample
from .tree_layout import MAX_TREE_NODES, TreeLayout
from .tree_verify import TreeVerification, tree_rejection_sample, verify_tree
from .tree_typical_acceptance import tree_typical_acceptance_sample

__all__ = [
    "GREEDY_TEMPERATURE", "LogprobsTensors", "MAX_TREE_NODES", "RandomStreams", "Sampler", "SamplerOutput",
    "SamplingMetadata", "TreeLayout", "TreeVerification", "sample_from_weights",
    "apply_min_p", "apply_temperature", "apply_top_k_top_p", "compute_logprobs",
    "probs_from_logits", "process_logits", "rejection_sample", "typical_acceptance_sample",
    "tree_rejection_sample", "tree_typical_acceptance_sample", "verify_tree",
]
