"""`specinfer bench`: the benchmark runner, which lives in `specinfer.bench.cli` and is imported
only when this subcommand runs (it pulls in plotting and the peers' packages)."""
from __future__ import annotations

import argparse

from specinfer.cli.errors import CliError, OneLineArgumentParser

HELP = "run a benchmark config or preset and write results.json plus PNG plots"
ADD_HELP = False  # `specinfer bench --help` is answered by the bench module's own parser


def add_arguments(p) -> None:
    p.set_defaults(takes_extra=True)


def _bench_cli():
    import importlib

    try:
        cli = importlib.import_module("specinfer.bench.cli")
    except ModuleNotFoundError as e:
        if e.name and (e.name == "specinfer.bench" or e.name.startswith("specinfer.bench.")):
            raise CliError("the benchmark runner (specinfer.bench) is not available in this install") from None
        raise CliError(f"the benchmark runner needs a package that is not installed: {e.name}") from None
    return cli


def run(args) -> int:
    cli = _bench_cli()
    parser = OneLineArgumentParser(prog="specinfer bench", description=cli.HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_arguments(parser)
    return int(cli.run(parser.parse_args(args.extra)) or 0)
