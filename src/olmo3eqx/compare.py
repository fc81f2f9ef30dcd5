"""`python -m olmo3eqx.compare`: the run-comparison command (olmo3eqx.tools.compare)."""

import sys

from olmo3eqx.tools.compare import main

if __name__ == "__main__":
    sys.exit(main())
