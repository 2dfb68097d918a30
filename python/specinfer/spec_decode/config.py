"""Speculative decoding configuration (frozen, validated at construction)."""
from __future__ import annotations

from dataclasses import dataclass, fields

from specinfer.spec_decode.registry import ACCEPTANCE_METHODS, MODEL_METHODS, POLICIES, SCORERS, proposer_names
from specinfer.spec_decode.token_tree import DynamicTree, StaticTree, parse_token_tree

STATIC_TREE_METHODS = ("draft_model", "mlp_speculator", "medusa", "eagle", "eagle3")
DYNAMIC_TREE_METHODS = ("draft_model", "eagle", "eagle3")

MAX_SPECULATIVE_TOKENS = 16
MAX_SUFFIX_TREE_NODES = 63  # suffix decoding: k is its largest tree, up to a tree's node limit


@dataclass(frozen=True)
class SpeculativeConfig:
    # a registered proposer: "draft_model", "ngram", "layer_skip", "mlp_speculator", ...; None: inferred
    # as vLLM does (infer_method): from `model` when given, layer_skip with exit_layer, else ngram
    method: str | None = None
    num_speculative_tokens: int = 4  # k, 1..16 (heads: at most what the head predicts)
    # draft_model: the draft (HF directory, .gguf file or pack name); heads (mlp_speculator, medusa,
    # eagle, eagle3): the head's checkpoint directory
    model: str | None = None
    exit_layer: int | None = None  # layer_skip: draft = the target's first E layers (1 <= E <= layers)
    # ngram / ngram_first: shortest suffix n-gram to match; None: 1 for ngram, 2 with ngram_first (a
    # lone repeated token is weak evidence beside a head's drafts)
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int = 4  # ngram: longest suffix n-gram to match
    # a head, draft model or layer_skip: each step, a request whose history repeats its latest n-gram
    # (prompt_lookup_min..max tokens) drafts the lookup's continuation, the others the model's
    # (spec_decode/ngram_first.py)
    ngram_first: bool = False
    acceptance_method: str = "rejection_sampler"  # or "typical_acceptance_sampler"
    posterior_threshold: float = 0.09  # typical acceptance
    posterior_alpha: float = 0.3  # typical acceptance
    scorer: str = "mqa"  # or "batch_expansion"
    disable_by_batch_size: int | None = None  # no speculation while >= this many requests run
    # "fixed": every request drafts up to num_speculative_tokens; "goodput": drafts per request and
    # step (0 .. num_speculative_tokens) chosen from measured acceptance and step cost
    # (spec_decode/policy.py; seeded requests keep the fixed k, so their tokens do not depend on
    # timing); "auto" (the default): "goodput" for chains, "fixed" with a token_tree
    policy: str = "auto"
    # True: skip logprob work in steps that verify drafts; tokens emitted in such steps carry
    # no logprobs (their entry in RequestOutput.logprobs is an empty dict).
    disable_logprobs: bool = False
    # Token tree (docs/trees.md): a list of paths (static, Medusa-choices semantics) or
    # {"dynamic": True, "num_nodes": N, "top_k": K, "depth": D} (EAGLE-2); None: chains of k.
    # With a tree, num_speculative_tokens bounds the tree's depth and its node count is the lookahead.
    token_tree: StaticTree | DynamicTree | list | dict | None = None
    # weights of the draft model or head: None = as the target's (the engine's `quantization`),
    # except a head over a float32 target on CPU, which is int8 where its GEMMs fit (the engine's
    # "auto"); "int8" = weight-only int8 GEMMs (CPU; spec_decode/head_quantization.py), "none" = dense.
    # Drafts only propose, so this changes acceptance and cost, never the output.
    quantization: str | None = None
    # draft_model under tensor parallelism: the draft is sharded over ranks 0 .. this - 1 (a divisor
    # of tensor_parallel_size, checked by the engine); None: as many ranks as the target
    draft_tensor_parallel_size: int | None = None
    # method "suffix" (SuffixDecoding, vLLM's key names; spec_decode/suffix.py): the tries' depth (the
    # longest match and deepest draft), how far a tree may grow per matched token
    # (num nodes <= factor * match length), the least cumulative probability of a drafted node, and
    # how many ended requests' outputs the global trie keeps (0: each request's own history only)
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_cached_requests: int = 10000

    def __post_init__(self):
        if self.method is None:
            object.__setattr__(self, "method", infer_method(self.model, self.exit_layer))
        if self.method not in proposer_names():
            raise ValueError(f"speculative.method {self.method!r} is unknown; choose one of {proposer_names()}")
        k = self.num_speculative_tokens
        k_max = MAX_SUFFIX_TREE_NODES if self.method == "suffix" else MAX_SPECULATIVE_TOKENS
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= k_max:
            raise ValueError(
                f"speculative.num_speculative_tokens must be an integer in 1..{k_max} (got {k!r})")
        self._check_suffix()
        if self.acceptance_method not in ACCEPTANCE_METHODS:
            raise ValueError(f"speculative.acceptance_method {self.acceptance_method!r} is unknown; "
                             f"choose one of {sorted(ACCEPTANCE_METHODS)}")
        if self.scorer not in SCORERS:
            raise ValueError(f"speculative.scorer {self.scorer!r} is unknown; choose one of {sorted(SCORERS)}")
        if self.method in MODEL_METHODS and not self.model:
            raise ValueError(f"speculative.model is required for method {self.method!r} "
                             f"({MODEL_METHODS[self.method]})")
        if self.method not in MODEL_METHODS and self.model is not None:
            raise ValueError(f"speculative.model does not apply to method {self.method!r}")
        if self.quantization is not None:
            if self.quantization not in ("none", "int8"):
                raise ValueError(f"speculative.quantization {self.quantization!r} is unknown; choose 'int8', "
                                 "'none' or None (as the target)")
            if self.method not in MODEL_METHODS:
                raise ValueError(f"speculative.quantization applies to a draft model or head (method "
                                 f"{self.method!r} has no weights of its own)")
        e = self.exit_layer
        if self.method == "layer_skip":
            if not isinstance(e, int) or isinstance(e, bool) or e < 1:
                raise ValueError(f"speculative.exit_layer must be an integer >= 1 for method 'layer_skip' (got {e!r})")
        elif e is not None:
            raise ValueError(f"speculative.exit_layer applies only to method 'layer_skip' (method is {self.method!r})")
        if not isinstance(self.ngram_first, bool):
            raise ValueError(f"speculative.ngram_first must be true or false (got {self.ngram_first!r})")
        if self.ngram_first and self.method == "ngram":
            raise ValueError("speculative.ngram_first puts prompt lookup before a model's drafts; method "
                             "'ngram' is prompt lookup alone")
        if self.prompt_lookup_min is None:
            object.__setattr__(self, "prompt_lookup_min", 2 if self.ngram_first else 1)
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(f"speculative.prompt_lookup_min/max must satisfy 1 <= min <= max (got {lo!r}, {hi!r})")
        if not 0.0 <= self.posterior_threshold <= 1.0:
            raise ValueError(f"speculative.posterior_threshold must be in [0, 1] (got {self.posterior_threshold!r})")
        if not 0.0 <= self.posterior_alpha <= 1.0:
            raise ValueError(f"speculative.posterior_alpha must be in [0, 1] (got {self.posterior_alpha!r})")
        if self.policy not in POLICIES:
            raise ValueError(f"speculative.policy {self.policy!r} is unknown; choose one of {list(POLICIES)}")
        tree = parse_token_tree(self.token_tree)
        object.__setattr__(self, "token_tree", tree)
        if tree is not None:
            allowed = DYNAMIC_TREE_METHODS if isinstance(tree, DynamicTree) else STATIC_TREE_METHODS
            if self.method not in allowed:
                kind = "dynamic" if isinstance(tree, DynamicTree) else "static"
                raise ValueError(f"speculative.token_tree: a {kind} tree needs method in {list(allowed)} "
                                 f"(method is {self.method!r}, whose drafts cannot branch)")
            if tree.max_depth > k:
                raise ValueError(f"speculative.token_tree is {tree.max_depth} deep but num_speculative_tokens "
                                 f"is {k}; raise num_speculative_tokens to at least the tree's depth")
            if self.policy == "goodput":
                raise ValueError("speculative.policy 'goodput' chooses chain lengths; it does not apply "
                                 "with a token_tree")
        dtp = self.draft_tensor_parallel_size
        if dtp is not None and (not isinstance(dtp, int) or isinstance(dtp, bool) or dtp < 1):
            raise ValueError(f"speculative.draft_tensor_parallel_size must be an integer >= 1 or None (got {dtp!r})")
        d = self.disable_by_batch_size
        if d is not None and (not isinstance(d, int) or d < 1):
            raise ValueError(f"speculative.disable_by_batch_size must be an integer >= 1 or None (got {d!r})")

    def _check_suffix(self) -> None:
        d = self.suffix_decoding_max_tree_depth
        if not isinstance(d, int) or isinstance(d, bool) or not 2 <= d <= 64:
            raise ValueError(f"speculative.suffix_decoding_max_tree_depth must be an integer in 2..64 (got {d!r})")
        f = self.suffix_decoding_max_spec_factor
        if not isinstance(f, (int, float)) or isinstance(f, bool) or not f > 0:
            raise ValueError(f"speculative.suffix_decoding_max_spec_factor must be > 0 (got {f!r})")
        p = self.suffix_decoding_min_token_prob
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0.0 <= p <= 1.0:
            raise ValueError(f"speculative.suffix_decoding_min_token_prob must be in [0, 1] (got {p!r})")
        c = self.suffix_decoding_max_cached_requests
        if not isinstance(c, int) or isinstance(c, bool) or c < 0:
            raise ValueError(f"speculative.suffix_decoding_max_cached_requests must be an integer >= 0 (got {c!r})")

    @property
    def drafts_trees(self) -> bool:
        """Proposals may branch: a token_tree, or suffix decoding's speculation trees."""
        return self.token_tree is not None or self.method == "suffix"

    @property
    def uses_goodput_policy(self) -> bool:
        """Whether drafts per request are chosen for goodput ("goodput", or "auto" on chains)."""
        return self.policy == "goodput" or (self.policy == "auto" and self.token_tree is None)

    @property
    def num_draft_slots(self) -> int:
        """Drafts one request may have verified per step: the tree's node count, else k."""
        return self.token_tree.num_nodes if self.token_tree is not None else self.num_speculative_tokens

    @classmethod
    def from_any(cls, value) -> "SpeculativeConfig | None":
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"speculative has unknown keys {unknown}; known: {sorted(known)}")
            return cls(**value)
        raise ValueError(f"speculative must be a SpeculativeConfig, a dict or None (got {type(value).__name__})")


def infer_method(model, exit_layer) -> str:
    """speculative.method when omitted, as vLLM infers it: from the draft's name (a head's kind
    is in its checkpoint's name: eagle3 / eagle / medusa / mlp_speculator), draft_model for any
    other model; layer_skip with exit_layer; ngram with neither."""
    if model is None:
        return "layer_skip" if exit_layer is not None else "ngram"
    name = str(model).lower().replace("-", "_")
    for key, method in (("eagle3", "eagle3"), ("eagle", "eagle"), ("medusa", "medusa"),
                        ("mlp_speculator", "mlp_speculator"), ("_mlp", "mlp_speculator")):
        if key in name:
            return method
    return "draft_model"
