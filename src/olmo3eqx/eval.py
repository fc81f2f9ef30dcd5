"""`python -m olmo3eqx.eval`: the checkpoint-evaluation command (olmo3eqx.tools.evaluate)."""

import sys

from olmo3eqx.tools.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
