"""Proposer registry: a method name maps to a module that builds its proposer (lazily imported).

Adding a proposer (mlp_speculator, medusa, eagle, ...) is one new module plus one line here.
"""
from __future__ import annotations

import importlib

_PROPOSERS: dict[str, str] = {
    "ngram": "specinfer.spec_decode.ngram:NgramProposer",
    "suffix": "specinfer.spec_decode.suffix:SuffixProposer",
    "draft_model": "specinfer.spec_decode.draft_model:draft_model_proposer",
    "layer_skip": "specinfer.spec_decode.layer_skip:LayerSkipProposer",
    "mlp_speculator": "specinfer.spec_decode.mlp_speculator:MLPSpeculatorProposer",
    "medusa": "specinfer.spec_decode.medusa:MedusaProposer",
    "eagle": "specinfer.spec_decode.eagle_proposer:EagleProposer",
    "eagle3": "specinfer.spec_decode.eagle_proposer:Eagle3Proposer",
}

# methods whose `model` names a checkpoint, and what it must be
MODEL_METHODS: dict[str, str] = {
    "draft_model": "a draft model path or pack",
    "mlp_speculator": "an MLP speculator checkpoint directory",
    "medusa": "a Medusa heads checkpoint directory",
    "eagle": "an EAGLE-1 checkpoint directory",
    "eagle3": "an EAGLE-3 checkpoint directory",
}

ACCEPTANCE_METHODS = frozenset({"rejection_sampler", "typical_acceptance_sampler"})
SCORERS = frozenset({"mqa", "batch_expansion"})
# drafts per request and step: "auto" (goodput on chains, fixed with a token tree), "fixed" (k), "goodput"
POLICIES = ("auto", "fixed", "goodput")


def register_proposer(name: str, target: str) -> None:
    """`target` is "module:Class", a subclass of specinfer.spec_decode.proposer.Proposer (its
    capabilities are declared attributes the engine reads, never probed)."""
    _PROPOSERS[name] = target


def proposer_names() -> list[str]:
    return sorted(_PROPOSERS)


def proposer_class(name: str):
    module_name, cls_name = _PROPOSERS[name].split(":")
    return getattr(importlib.import_module(module_name), cls_name)
