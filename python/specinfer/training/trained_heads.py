"""Named draft heads: trained once on this machine by a fixed recipe, then cached.

No hub is reachable and weights are not committed, so a head for a model pack is made here, by
`specinfer train-heads`' own pipeline (distill_data + head_training) with every setting fixed
(a step count, not minutes): the same recipe on the same machine gives the same head. The cache
entry is `<cache>/heads/<name>-<key>/`, where the key hashes the recipe, the resolved training
dtype and TRAINING_REVISION (bumped when the training code changes what a recipe makes), so a
changed recipe never reuses an old head. A head is trained in a `.partial` sibling directory and
renamed into place when complete, under a file lock: a killed run leaves no half-written head (the
next call resumes its training exactly), and two processes asking at once train it once. The
distillation data (the slow part) is cached beside the heads, shared by every head of one target.

    Generator("smollm2-135m", speculative={"method": "eagle", "model": "smollm2-135m-eagle"})

trains the head on first use (minutes; progress on stderr) and loads the cached one after that.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

TRAINING_REVISION = 3  # bump when the training code changes what a recipe produces


@dataclass(frozen=True)
class HeadRecipe:
    name: str  # what speculative.model names
    target: str  # the model pack the head is trained for
    method: str  # "eagle", "eagle3", "medusa" or "mlp_speculator"
    prompts: int  # distillation prompts (distill_data.training_prompts)
    max_tokens: int  # target tokens generated per prompt
    steps: int  # optimizer steps: fixed, so the result does not depend on the machine's speed
    num_heads: int = 4
    draft_vocab_size: int = 8192
    ttt_steps: int = 1  # eagle: chain steps unrolled per training pair (eagle_training)
    lr_schedule: str = "wsd"  # head_training.learning_rate
    seed: int = 0
    task_shaped_per_task: int = 0  # task-shaped prompts per bench task added to `prompts` (distill_data)
    self_instruct: int = 0  # questions the target writes itself, in the templated questions' place (distill_data)
    minutes: float = 0.0  # about how long it takes on a 2-core CI-class machine (shown to the user)

    def key(self, train_dtype: str) -> str:
        """train_dtype: the resolved precision of training, which is also the data's (bfloat16 where
        the CPU multiplies it natively, else float32)."""
        fields = {k: v for k, v in asdict(self).items() if k != "minutes"}
        for name in ("task_shaped_per_task", "self_instruct"):  # recipes without them keep the keys they had
            if not fields[name]:
                del fields[name]
        blob = json.dumps({**fields, "train_dtype": train_dtype, "data_dtype": train_dtype,
                           "revision": TRAINING_REVISION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


TRAINED_HEADS: dict[str, HeadRecipe] = {r.name: r for r in (
    # EAGLE: ~4.6 steps/s on 2 Zen 5 cores, so 3600 steps train in ~13 minutes (after the
    # distillation data: ~14 minutes there in bf16, ~5 on an Intel AMX box)
    HeadRecipe("smollm2-135m-eagle", "smollm2-135m", "eagle", prompts=1000, max_tokens=96, steps=3600, minutes=26),
    HeadRecipe("smollm2-135m-medusa", "smollm2-135m", "medusa", prompts=1000, max_tokens=96, steps=6000,
               lr_schedule="invsqrt", minutes=21),
    HeadRecipe("smollm2-135m-mlp", "smollm2-135m", "mlp_speculator", prompts=1000, max_tokens=96, steps=6000,
               lr_schedule="invsqrt", minutes=20),
)}


def is_trained_head_name(name: object, table: dict[str, HeadRecipe] | None = None) -> bool:
    return isinstance(name, str) and name in (TRAINED_HEADS if table is None else table)


def heads_cache_dir() -> Path:
    from specinfer.packs import default_cache_dir

    return default_cache_dir().parent / "heads"


def _same_target(target: str, pack: str) -> bool:
    if target == pack:
        return True
    from specinfer.packs import is_pack_name, resolve_pack

    if not is_pack_name(pack) or not Path(target).is_file():
        return False
    return Path(target).resolve() == resolve_pack(pack).resolve()


def resolve_head(model: str, method: str, target: str, *, table: dict[str, HeadRecipe] | None = None,
                 cache_dir: Path | None = None, progress: bool = True) -> str:
    """speculative.model as a checkpoint directory: a trained head's name becomes its cache entry
    (trained first if absent); anything else is returned as given."""
    table = TRAINED_HEADS if table is None else table
    recipe = table.get(model) if isinstance(model, str) else None
    if recipe is None:
        return model
    if recipe.method != method:
        raise ValueError(f"speculative.model {model!r} is a {recipe.method} head; speculative.method is {method!r}")
    if not _same_target(str(target), recipe.target):
        raise ValueError(f"speculative.model {model!r} is a head trained for the target {recipe.target!r}; "
                         f"this engine's target is {str(target)!r}")
    from specinfer.packs.file_lock import file_lock
    from specinfer.platform.cpu import bf16_matmul_is_native

    dtype = "bfloat16" if bf16_matmul_is_native() else "float32"
    root = Path(cache_dir) if cache_dir is not None else heads_cache_dir()
    final = root / f"{recipe.name}-{recipe.key(dtype)}"
    if (final / "train_report.json").is_file():
        return str(final)
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / f".{final.name}.lock"):
        if (final / "train_report.json").is_file():  # another process trained it meanwhile
            return str(final)
        print(f"speculative.model {model!r}: training this head once on this machine ({recipe.method} for "
              f"{recipe.target}, {recipe.steps} steps; about {recipe.minutes:g} minutes on 2 cores); "
              f"cached in {final}", file=sys.stderr)
        work = root / f".{final.name}.partial"  # kept if interrupted: the next call resumes it exactly
        from specinfer.training import head_training

        cfg = head_training.TrainConfig(recipe.method, num_heads=recipe.num_heads, steps=recipe.steps,
                                        seed=recipe.seed, draft_vocab_size=recipe.draft_vocab_size,
                                        ttt_steps=recipe.ttt_steps, lr_schedule=recipe.lr_schedule,
                                        train_dtype=dtype)
        # the distillation data is shared by every head of the target (built once: the slow part)
        # built in the training precision: bfloat16 where native (~3x faster than float32)
        suffix = "" if dtype == "float32" else f"-{dtype}"
        data = root / f"distill-{re.sub(r'[^A-Za-z0-9_.-]', '_', recipe.target)}{suffix}.pt"
        if recipe.task_shaped_per_task:
            data = data.with_name(f"{data.stem}-tasks{recipe.task_shaped_per_task}.pt")
        if recipe.self_instruct:
            data = data.with_name(f"{data.stem}-si{recipe.self_instruct}.pt")
        head_training.train_head(recipe.target, work, cfg, recipe.prompts, recipe.max_tokens, progress=progress,
                                 data_path=data, data_dtype=dtype, task_shaped_per_task=recipe.task_shaped_per_task,
                                 self_instruct=recipe.self_instruct)
        (work / "train_state.pt").unlink(missing_ok=True)  # not part of the head
        if final.exists():  # a damaged entry (no report): replaced
            shutil.rmtree(final)
        work.rename(final)
    return str(final)
