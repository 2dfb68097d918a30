"""The `specinfer` command line: one subcommand per module, errors as one line, never a traceback."""
from __future__ import annotations

import argparse
import sys

from specinfer.cli import demo, models

SUBCOMMANDS = {"demo": demo, "models": models}


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specinfer", description="Fast, lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("specinfer: interrupted", file=sys.stderr)
        return 130
    except (CliError, ValueError, FileNotFoundError, OSError) as e:
        print(f"specinfer {args.command}: error: {e}", file=sys.stderr)
        return 2
