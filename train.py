"""Train OLMo 3: `python train.py [--config configs/X.yaml] [--section.field value ...]` (see --help)."""

import sys

if __name__ == "__main__":
    from olmo3eqx.tools.hostmem import reexec_with_caching_malloc

    reexec_with_caching_malloc()  # on CPU hosts, once, before jax is imported (see olmo3eqx/tools/hostmem.py)
    from olmo3eqx.train import main

    sys.exit(main())
