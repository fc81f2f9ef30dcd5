"""Regenerate the mix lists shipped in olmo3eqx/data/mix_lists/ from the installed ai2-olmo-core, byte for byte.

    python -m olmo3eqx.tools.regenerate_mixes [--out DIR]

Needs ai2-olmo-core (the test extra's reference packages); the lists are copied verbatim, so resolving a mix at
run time (olmo3eqx.data.mixes) reads exactly the lines OLMo-core's `DataMix.build` reads, without torch.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources

from olmo3eqx import exits, storage
from olmo3eqx.data.mixes import SHIPPED, shipped_mix_dir


def olmo_core_mix_file(name: str) -> bytes:
    return (resources.files("olmo_core") / "data" / "mixes" / f"{name}.txt").read_bytes()


def regenerate(out: str) -> list[str]:
    """Every shipped mix list written under directory `out` (local, gs:// or s3://); their paths."""
    storage.makedirs(out)
    written = []
    for name in SHIPPED:
        path = storage.join(out, f"{name}.txt")
        storage.write_bytes(path, olmo_core_mix_file(name))
        written.append(path)
    return written


@exits.command
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(shipped_mix_dir()), help="where to write (default: the package)")
    args = parser.parse_args(argv)
    out = storage.check(args.out, "--out", write=True)
    import olmo_core  # noqa: F401 - not installed: one sentence naming the fix (exits.EXTRAS), before anything is written

    for path in regenerate(out):
        print(f"wrote {storage.redact(path)} ({len(storage.read_text(path).splitlines())} lines)")
    return exits.OK


if __name__ == "__main__":
    sys.exit(main())
