"""`specinfer train-heads`: fit a draft head to a target by self-distillation on CPU."""
from __future__ import annotations

import json
import sys
from pathlib import Path

HELP = "train a draft head (medusa, mlp_speculator, eagle, eagle3) for a target by self-distillation"
DESCRIPTION = HELP + """

The target greedily continues prompts (specinfer's bench prompt sets past the first 8 of each task,
which the bench measures; 320 everyday assistant questions; then chunks of the Python standard
library's sources wrapped in task-shaped instructions, through the target's chat template); the head learns those continuations from the target's hidden states.
The head is written to --out in its public layout (use it with --method M --head DIR); rerunning
the same command resumes from --out/train_state.pt. Ends with a held-out acceptance estimate
(also in --out/train_report.json). Named heads (speculative.model "smollm2-135m-eagle", "-medusa",
"-mlp") run this pipeline by a fixed recipe on first use and are cached
(training/trained_heads.py)."""


def add_arguments(p) -> None:
    p.add_argument("model", metavar="TARGET", help="target model (pack name, HF directory or .gguf)")
    p.add_argument("--method", required=True, choices=("medusa", "mlp_speculator", "eagle", "eagle3"),
                   help="head type")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (the head's checkpoint)")
    p.add_argument("--num-heads", type=int, default=4, metavar="K", help="heads / stages (max drafts), default 4")
    p.add_argument("--prompts", type=int, default=400, metavar="N", help="training prompts (default 400)")
    p.add_argument("--self-instruct", type=int, default=0, metavar="N",
                   help="N questions the target writes itself (sampled from its chat template's user-turn opening, "
                        "as Magpie does) take the place of the templated everyday questions; needs a chat template")
    p.add_argument("--task-shaped", type=int, default=0, metavar="N",
                   help="add N prompts per bench task shape (code completion, code editing, summarization, qa) "
                        "cut from standard-library modules the bench does not use (default 0)")
    p.add_argument("--max-tokens", type=int, default=96, metavar="N", help="target tokens per prompt (default 96)")
    p.add_argument("--steps", type=int, default=3000, metavar="N", help="optimizer steps (default 3000)")
    p.add_argument("--minutes", type=float, default=None, metavar="M", help="stop training after M minutes (and save; rerun to resume). Under the "
                        "wsd schedule the rate reaches zero only at --steps: a run cut short ends before "
                        "its decay")
    p.add_argument("--batch-size", type=int, default=64, metavar="N")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 2e-3 for eagle, else 3e-3)")
    p.add_argument("--lr-schedule", choices=("wsd", "invsqrt"), default=None,
                   help="wsd (eagle's default): warm-up, constant, then linear to zero over the last 30%% of --steps "
                        "(a resumed run keeps its --steps); invsqrt (the others' default): inverse-square-root "
                        "decay, a run can be extended")
    p.add_argument("--seed", type=int, default=0, metavar="N",
                   help="the run's seed, as --seed is everywhere: every random draw of the run (the head's "
                        "initialization, the batch order, self-instruct questions) comes from it (default: 0)")
    p.add_argument("--draft-vocab-size", type=int, default=8192, metavar="N",
                   help="eagle, eagle3, medusa: draft vocabulary size (the target's most frequent tokens; d2t / "
                        "Medusa's token_map in the checkpoint), default 8192; the target's vocabulary size or more: none")
    p.add_argument("--ttt-steps", type=int, default=None, metavar="S",
                   help="eagle: chain steps unrolled per training pair (training-time test; default 1: teacher-forced)")
    p.add_argument("--train-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="matmul precision of training (fp32 master weights either way); auto: bfloat16 where "
                        "the CPU multiplies bf16 natively (AMX / avx512_bf16), else float32")
    p.add_argument("--data-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="precision the target builds the distillation data in (its greedy continuations and "
                        "hidden states); auto: bfloat16 where the CPU multiplies bf16 natively (~3x faster), "
                        "else float32")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    from specinfer.cli.options import check_model
    from specinfer.platform.cpu import bf16_matmul_is_native
    from specinfer.training.head_training import TrainConfig, train_head

    check_model(args.model, "target")
    native = "bfloat16" if bf16_matmul_is_native() else "float32"
    dtype = args.train_dtype if args.train_dtype != "auto" else native
    data_dtype = args.data_dtype if args.data_dtype != "auto" else native
    cfg = TrainConfig(args.method, num_heads=args.num_heads, steps=args.steps, batch_size=args.batch_size,
                      lr=args.lr, lr_schedule=args.lr_schedule, seed=args.seed, draft_vocab_size=args.draft_vocab_size, train_dtype=dtype,
                      **({} if args.ttt_steps is None else {"ttt_steps": args.ttt_steps}),
                      max_seconds=None if args.minutes is None else 60 * args.minutes)
    report = train_head(args.model, Path(args.out), cfg, args.prompts, args.max_tokens, progress=not args.no_progress,
                        data_dtype=data_dtype, task_shaped_per_task=args.task_shaped,
                        self_instruct=args.self_instruct)
    h = report["held_out"]
    print(json.dumps(report, indent=2))
    print(f"held-out estimate: mean acceptance length {h['mean_acceptance_length']:.2f} at k={args.num_heads}, "
          f"acceptance per position {[round(a, 3) for a in h['acceptance_per_position']]}", file=sys.stderr)
    return 0
