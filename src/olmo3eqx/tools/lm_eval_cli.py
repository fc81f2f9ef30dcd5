"""`olmo3eqx-lm-eval`: lm-evaluation-harness's own command line with the "olmo3eqx" model registered
(olmo3eqx.tools.lm_eval_adapter).

A module of its own because the adapter imports lm_eval when it is imported: the command imports it inside
exits.command, so without lm_eval (the `lm-eval` extra) the command, `--help` included, says in one sentence which
pip install fixes it.
"""

from __future__ import annotations

import sys

from olmo3eqx import exits


@exits.command
def main() -> int:
    from lm_eval.__main__ import cli_evaluate

    import olmo3eqx.tools.lm_eval_adapter  # noqa: F401 - registers the "olmo3eqx" model

    cli_evaluate()
    return exits.OK


if __name__ == "__main__":
    sys.exit(main())
