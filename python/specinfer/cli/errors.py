"""The one exception type the CLI treats as the user's mistake."""
from __future__ import annotations

import argparse


class CliError(Exception):
    """A user-facing error: printed as one line `specinfer <cmd>: error: ...`, exit status 2."""


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (`specinfer generate: error: ...`), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")
