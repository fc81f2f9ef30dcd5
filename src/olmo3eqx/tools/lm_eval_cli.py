"""`olmo3eqx-lm-eval`: lm-evaluation-harness's own command line with the "olmo3eqx" model registered
(olmo3eqx.tools.lm_eval_adapter).

A module of its own because the adapter imports lm_eval when it is imported: the command imports it inside
exits.command, so without lm_eval (the `lm-eval` extra) the command, `--help` included, says in one sentence which
pip install fixes it.
"""

from __future__ import annotations

import os
import sys

from olmo3eqx import exits, jaxenv


@exits.command
def main() -> int:
    if "jax" not in sys.modules:  # before JAX starts (see olmo3eqx.tools.evaluate.main)
        jaxenv.prepare_speaking(os.environ)
    from lm_eval.__main__ import cli_evaluate

    import olmo3eqx.tools.lm_eval_adapter  # noqa: F401 - registers the "olmo3eqx" model
    from olmo3eqx import distributed
    from olmo3eqx.config import DistConfig

    distributed.initialize(DistConfig())  # several processes score together
    cli_evaluate()
    return exits.OK


if __name__ == "__main__":
    sys.exit(main())
