"""lm-evaluation-harness adapter: olmo3eqx checkpoints as the `lm_eval` model "olmo3eqx".

    pip install -e ".[lm-eval]"
    olmo3eqx-lm-eval --model olmo3eqx --model_args ckpt=runs/tiny,tokenizer=bytes --tasks ...

(the harness's own CLI, with this model registered first: olmo3eqx.tools.lm_eval_cli), or from Python:

    import lm_eval, olmo3eqx.tools.lm_eval_adapter  # registers "olmo3eqx"
    lm_eval.simple_evaluate(model="olmo3eqx", model_args="ckpt=runs/tiny", tasks=["hellaswag"])

Model arguments: `ckpt` (anything `olmo3eqx-eval --ckpt` takes), `tokenizer` ('bytes' or a
tokenizer.json; default: the run's eval.tokenizer, an HF directory's tokenizer.json, else bytes), `max_length`
(default: the run's data.seq_len), `dtype` (weights and compute; default the checkpoint's compute dtype) and the
harness's `batch_size`. The checkpoint is restored straight onto the devices' shards (olmo3eqx.checkpoint.load_any);
under several processes (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID) `olmo3eqx-lm-eval` joins them
first and every process runs the harness over the same requests. Scoring is olmo3eqx.evaluator's jitted, bucketed,
sharded scorer: `loglikelihood` sums the continuation's log-probabilities given the left-truncated context,
`loglikelihood_rolling` scores a whole text in the harness's disjoint windows after an EOS prefix;
`generate_until` generates with olmo3eqx.generate (KV cache, the harness's stop sequences, greedy unless do_sample).
"""

from __future__ import annotations


try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:  # an optional extra
    raise ImportError("The lm-evaluation-harness adapter needs the lm_eval package: "
                      "pip install -e '.[lm-eval]' (or pip install lm_eval).") from e

import numpy as np

DEFAULT_BATCH = 4
"""Sequences per device and jitted batch when the harness passes no batch size (or 'auto')."""
DEFAULT_GEN_TOKENS = 256
"""New tokens of a generate_until request that names no max_gen_toks (the harness's own default)."""


@register_model("olmo3eqx")
class OLMo3EqxLM(LM):
    def __init__(self, ckpt: str, tokenizer: str | None = None, max_length: int | str | None = None,
                 batch_size: int | str | None = None, dtype: str | None = None, **_harness_kwargs):
        super().__init__()
        from olmo3eqx.checkpoint.model import load_any
        from olmo3eqx.evaluator import ShardedScorer
        from olmo3eqx.sharding import data_parallel_size, model_shardings, node_mesh
        from olmo3eqx.tasks import Tokenizer
        from olmo3eqx.tools.evaluate import DEFAULT_SEQ_LEN, run_config

        mesh = node_mesh()
        model, cfg, stored, hf_tokenizer, _, _ = load_any(ckpt, mesh, dtype)
        run = run_config(stored)
        self.tokenizer = Tokenizer.load(tokenizer or (run.eval.tokenizer if run else hf_tokenizer or "bytes"))
        self.max_length = int(max_length) if max_length else (
            run.data.seq_len if run else min(DEFAULT_SEQ_LEN, cfg.max_position_embeddings))
        per_device = int(batch_size) if str(batch_size or "").isdigit() else DEFAULT_BATCH
        shardings = model_shardings(model, mesh)
        self.model = model
        self.cfg = cfg
        self.scorer = ShardedScorer(mesh, shardings, per_device * data_parallel_size(mesh))

    def _score(self, pairs: list[tuple]) -> tuple[np.ndarray, np.ndarray]:
        """(summed log-likelihood, greedy) of (context ids, continuation ids) pairs."""
        from olmo3eqx.tasks import build_request

        requests = [build_request(np.asarray(c, np.int64), np.asarray(k, np.int64), max_len=self.max_length,
                                        eos_id=self.tokenizer.eos_id) for c, k in pairs]
        if not requests:
            return np.zeros(0), np.zeros(0, bool)
        top = max(int(np.concatenate(r[:2]).max()) for r in requests)
        if top >= self.cfg.vocab_size:
            raise ValueError(f"Token id {top} from tokenizer {self.tokenizer.spec} is >= the model's vocab_size "
                             f"{self.cfg.vocab_size}; pass the tokenizer the model was trained with.")
        return self.scorer.score_requests(self.model, requests, max_len=self.max_length, pad_id=self.cfg.pad_token_id)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        contexts = self.tokenizer.encode([r.args[0] for r in requests])
        continuations = self.tokenizer.encode([r.args[1] for r in requests])
        logprob, greedy = self._score(list(zip(contexts, continuations)))
        return [(float(lp), bool(g)) for lp, g in zip(logprob, greedy)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        texts = self.tokenizer.encode([r.args[0] for r in requests])
        pairs, owner = [], []
        for i, tokens in enumerate(texts):
            for window in get_rolling_token_windows(tokens.tolist(), prefix_token=self.tokenizer.eos_id,
                                                    max_seq_len=self.max_length, context_len=1):
                pairs.append(make_disjoint_window(window))
                owner.append(i)
        logprob, _ = self._score(pairs)
        totals = np.zeros(len(requests))
        np.add.at(totals, np.asarray(owner, np.int64), logprob)
        return [float(t) for t in totals]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each request's (context, generation kwargs) completed by olmo3eqx.generate: until the first of `until`
        (cut before it) or EOS, at most `max_gen_toks` new tokens (default DEFAULT_GEN_TOKENS), greedy unless
        `do_sample` (then `temperature`, `top_k`, `top_p`); the context left-truncated to max_length minus the new
        tokens. Requests with the same settings are generated together, a scorer batch at a time."""
        from olmo3eqx.decode import Sampler
        from olmo3eqx.generate import generate
        groups: dict[tuple, list[tuple[int, str]]] = {}
        for i, request in enumerate(requests):
            context, kwargs = request.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            new = int(kwargs.get("max_gen_toks") or DEFAULT_GEN_TOKENS)
            sample = bool(kwargs.get("do_sample", False))
            temperature = float(kwargs.get("temperature") or (1.0 if sample else 0.0)) if sample else 0.0
            sampler = Sampler(temperature, int(kwargs.get("top_k") or 0), float(kwargs.get("top_p") or 1.0))
            groups.setdefault((tuple(until), new, sampler), []).append((i, context))
        out: list[str] = [""] * len(requests)
        for (until, new, sampler), items in groups.items():
            keep = self.max_length - new
            if keep < 1:
                raise ValueError(f"max_gen_toks {new} leaves no room for a context within max_length "
                                 f"{self.max_length}; pass a larger max_length in --model_args.")
            for start in range(0, len(items), self.scorer.batch_size):
                batch = items[start:start + self.scorer.batch_size]
                ids = [x[-keep:].tolist() or [self.tokenizer.eos_id]
                       for x in self.tokenizer.encode([c for _, c in batch])]
                done = generate(self.model, ids, max_new_tokens=new, sampler=sampler, stop=list(until),
                                decode=self.tokenizer.decode, mesh=self.scorer.mesh)
                for (i, _), completion in zip(batch, done):
                    out[i] = completion.text
        return out
