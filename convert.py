"""Checkpoint conversion: `python convert.py {hf-to-orbax,orbax-to-hf,parity,demo} --help`."""

import sys

from olmo3eqx.tools.convert import main

if __name__ == "__main__":
    sys.exit(main())
