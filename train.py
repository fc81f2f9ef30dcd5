"""Train OLMo 3: `python train.py [--config configs/X.yaml] [--section.field value ...]` (see --help)."""

import sys

from olmo3eqx.train import main

if __name__ == "__main__":
    sys.exit(main())
