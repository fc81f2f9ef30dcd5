"""Train OLMo 3: `python train.py [--config configs/X.yaml] [--section.field value ...]` (see --help).

The same command as the `olmo3eqx-train` console script and `python -m olmo3eqx.train`."""

import sys

if __name__ == "__main__":
    from olmo3eqx.train import cli  # the module imports only the standard library: jax comes after the re-exec

    sys.exit(cli())
