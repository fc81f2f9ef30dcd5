"""Issue 62's storage row, repeated: the outage run of tests/outage.py (two train.py processes over jax.distributed on
loopback, their run directory in moto's S3, the store taken away for good once checkpoint 4 is committed, so process
0's next flush of metrics.jsonl fails) run `--runs` times. Each row gives both exit codes and the seconds from the
first `error` line to the last process's exit; the run passes when every process of every run exits 74 within
`--within` seconds of that line.

    python bench/bench_outage.py [--runs 10] [--within 60] [--show-stderr]

Run with the sources under test first on PYTHONPATH (an absolute path: the trainers run in their own working
directories). Prints the rows and a summary; exits 1 when a run fails.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the emulator harness and the scenario the tests use


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--within", type=float, default=60.0, help="seconds from the first error to the last exit")
    parser.add_argument("--show-stderr", action="store_true", help="print each process's stderr tail")
    args = parser.parse_args()
    from outage import outage_run
    from stores import Stores

    import olmo3eqx

    print(f"olmo3eqx from {Path(olmo3eqx.__file__).parent}", flush=True)
    passed = 0
    with tempfile.TemporaryDirectory(prefix="bench-outage-") as tmp:
        stores = Stores(Path(tmp) / "stores")
        stores.start()
        import os

        os.environ.update(stores.env)
        try:
            for n in range(1, args.runs + 1):
                started = time.monotonic()
                run = outage_run(stores, Path(tmp) / f"run-{n}", after_error_s=args.within + 30)
                took = run.seconds_to_exit()
                ok = run.codes == [74] * len(run.codes) and took is not None and took <= args.within
                passed += ok
                shown = "no exit" if took is None else f"{took:5.1f} s"
                print(f"run {n:2d}: exit codes {run.codes}, first error to last exit {shown}, "
                      f"whole run {time.monotonic() - started:5.1f} s: {'ok' if ok else 'FAILED'}", flush=True)
                if args.show_stderr or not ok:
                    for i, err in enumerate(run.stderr):
                        print(f"  --- process {i} stderr (tail):\n" + "\n".join(
                            "  " + line for line in err.splitlines()[-15:]), flush=True)
        finally:
            stores.stop()
    print(f"{passed} of {args.runs} runs: every process exited 74 within {args.within:g} s of the first error")
    return 0 if passed == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
