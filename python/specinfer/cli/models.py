"""`specinfer models`: the known model packs, whether each is installed, size and hash status."""
from __future__ import annotations

HELP = "list the known model packs (installed?, size, hash status)"


def add_arguments(p) -> None:
    p.add_argument("--verify", action="store_true", help="hash every installed pack (slow for large packs)")


def run(args) -> int:
    from specinfer.packs import list_packs

    rows = list_packs(verify=args.verify)
    print(f"{'pack':<22} {'installed':<10} {'size':>10}  {'hash':<14} install")
    for s in rows:
        size = f"{s.size_bytes / 2**20:.0f} MiB" if s.size_bytes else "-"
        status = s.hash_status.value if hasattr(s.hash_status, "value") else str(s.hash_status)
        print(f"{s.name:<22} {'yes' if s.installed else 'no':<10} {size:>10}  {status:<14} "
              f"{'' if s.installed else s.install_command}")
    return 0
