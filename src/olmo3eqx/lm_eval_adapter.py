"""`import olmo3eqx.lm_eval_adapter` registers the lm-evaluation-harness model "olmo3eqx";
`python -m olmo3eqx.lm_eval_adapter` is the harness's CLI with it registered (olmo3eqx.tools.lm_eval_adapter)."""

import sys

from olmo3eqx.tools.lm_eval_adapter import OLMo3EqxLM, main  # noqa: F401 - importing registers the model

if __name__ == "__main__":
    sys.exit(main())
