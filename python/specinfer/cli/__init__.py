"""The `specinfer` command line: one subcommand per module, errors as one line, never a traceback.

Each subcommand module exposes `HELP`, `add_arguments(parser)` and `run(args) -> int`. Modules
import torch and the engine inside `run`, so `specinfer --help` stays fast. `bench` lives in
`specinfer.bench.cli` and is imported only when `specinfer bench` runs.
"""
from __future__ import annotations

import argparse
import os
import sys

from specinfer.cli import bench, chat, demo, generate, models, serve, train_heads
from specinfer.cli.errors import CliError, OneLineArgumentParser

SUBCOMMANDS = {"generate": generate, "chat": chat, "serve": serve, "bench": bench, "demo": demo, "models": models,
               "train-heads": train_heads}

# errors that are the user's (bad value, missing file, unwritable path, unknown pack): exit 2
USER_ERRORS = (CliError, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
               PermissionError)

__all__ = ["CliError", "SUBCOMMANDS", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog="specinfer", description="Fast, lossless speculative decoding.",
        epilog="Run `specinfer <command> --help` for a command's options.")
    from specinfer import __version__

    parser.add_argument("--version", action="version", version=f"specinfer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name, module in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=module.HELP, description=getattr(module, "DESCRIPTION", module.HELP),
                           add_help=getattr(module, "ADD_HELP", True),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    return parser


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, KeyError):  # str(KeyError('x')) is "'x'"
        text = f"unknown key {text}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "takes_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print(f"specinfer {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `specinfer generate ... | head`: the reader left; not an error of ours
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except USER_ERRORS as e:
        print(f"specinfer {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # a bug: still one line, with the traceback on request
        if os.environ.get("SPECINFER_TRACEBACK"):
            raise
        print(f"specinfer {args.command}: error: internal error ({type(e).__name__}: {_one_line(e)}); "
              "rerun with SPECINFER_TRACEBACK=1 for the traceback", file=sys.stderr)
        return 1
