"""Regenerate the mix lists shipped in olmo3eqx/data/mix_lists/ from the installed ai2-olmo-core, byte for byte.

    python -m olmo3eqx.tools.regenerate_mixes [--out DIR]

Needs ai2-olmo-core (the test extra's reference packages); the lists are copied verbatim, so resolving a mix at
run time (olmo3eqx.data.mixes) reads exactly the lines OLMo-core's `DataMix.build` reads, without torch.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from olmo3eqx.data.mixes import SHIPPED, shipped_mix_dir


def olmo_core_mix_file(name: str) -> bytes:
    return (resources.files("olmo_core") / "data" / "mixes" / f"{name}.txt").read_bytes()


def regenerate(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in SHIPPED:
        path = out / f"{name}.txt"
        path.write_bytes(olmo_core_mix_file(name))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=shipped_mix_dir(), help="where to write (default: the package)")
    args = parser.parse_args(argv)
    try:
        import olmo_core  # noqa: F401
    except ImportError:
        print("error: ai2-olmo-core is not installed; pip install --no-deps -r requirements-reference.txt",
              file=sys.stderr)
        return 2
    for path in regenerate(args.out):
        print(f"wrote {path} ({sum(1 for _ in path.open())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
