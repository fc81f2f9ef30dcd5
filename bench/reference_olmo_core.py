"""OLMo-core's side of the reference run (bench/reference_run.py): AI2's own Trainer on CPU, one process, gloo.

    python bench/reference_olmo_core.py init  --spec SPEC.json --out DIR   # OLMo-core's initial weights
    python bench/reference_olmo_core.py train --spec SPEC.json              # one stage; rerun to resume

`init` builds the model as the Trainer does (TransformerTrainModule materialises and initialises it, init seed 0) and
writes its weights twice: DIR/init.safetensors (OLMo-core's names, what `train` starts stage 1 from) and DIR/hf/
(OLMo-core's save_hf_model, what `convert.py hf-to-orbax` turns into our starting checkpoint).

`train` runs OLMo-core's Trainer with its TransformerTrainModule (SkipStepAdamW, the scheduler, z-loss, clipping,
the embedding without weight decay, configured as AI2's OLMo 3 scripts configure them with the numbers of our
OptimConfig), a NumpyFSLDataLoader over its NumpyFSLDataset of the stage's token files, its CheckpointerCallback and
its LMEvaluatorCallback over NumpyPaddedFSLDatasets of the held-out files. Stage 2 loads stage 1's last checkpoint
as AI2's midtraining script does (load_trainer_state False, load_optim_state True); a rerun of the same command
resumes from the stage's own save folder, OLMo-core's own resume (which, in 3.0.0, starts the spike guard's history
afresh). Every step's metrics go to the spec's `metrics` file, one JSON object per line, under OLMo-core's names
(JsonlMetrics).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import torch

INIT_WEIGHTS = "init.safetensors"
HF_DIR = "hf"


def model_config(spec: dict):
    """OLMo-core's olmo3_14M with the spec's vocabulary and OLMo 3's 3:1 sliding/global layout at the spec's window."""
    from olmo_core.nn.attention import AttentionBackendName, SlidingWindowAttentionConfig
    from olmo_core.nn.transformer import TransformerConfig

    w = spec["window"]
    return TransformerConfig.olmo3_14M(
        vocab_size=spec["model_vocab_size"], attn_backend=AttentionBackendName.torch,  # flash_2 is GPU-only
        sliding_window=SlidingWindowAttentionConfig(pattern=[w, w, w, -1], force_full_attention_on_first_layer=False,
                                                    force_full_attention_on_last_layer=True))


def scheduler(optim: dict):
    """AI2's schedulers for our OptimConfig's schedule: CosWithWarmup (stage 1) or LinearWithWarmup (stage 2)."""
    from olmo_core.optim import CosWithWarmup, LinearWithWarmup

    kinds = {"cosine": CosWithWarmup, "linear": LinearWithWarmup}
    if optim["schedule"] not in kinds:
        raise ValueError(f"optim.schedule {optim['schedule']!r} has no OLMo-core scheduler here; use cosine or linear.")
    return kinds[optim["schedule"]](warmup=optim["warmup_steps"], alpha_f=optim["final_lr_ratio"])


def train_module(spec: dict):
    """OLMo-core's TransformerTrainModule with SkipStepAdamW and the embedding excluded from weight decay, as AI2's
    OLMo-3-1025-7B-pretrain-1.py and -midtrain.py configure them, with our OptimConfig's numbers (spec["optim"])."""
    from olmo_core.optim import OptimGroupOverride, SkipStepAdamWConfig
    from olmo_core.train.train_module import TransformerTrainModule

    o = spec["optim"]
    tokens = spec["seq_len"] * spec["global_batch"]
    return TransformerTrainModule(
        model_config(spec).build(init_device="meta"),
        optim=SkipStepAdamWConfig(
            lr=o["lr"], betas=(o["b1"], o["b2"]), eps=o["eps"], weight_decay=o["weight_decay"],
            rolling_interval_length=o["spike_window"], sigma_factor=int(o["spike_sigma"]),
            group_overrides=[OptimGroupOverride(params=["embeddings.weight"], opts={"weight_decay": 0.0})]),
        scheduler=scheduler(o), rank_microbatch_size=tokens, max_sequence_length=spec["seq_len"],
        z_loss_multiplier=o["z_loss"], max_grad_norm=o["clip_grad_norm"], device=torch.device("cpu"))


def init(spec: dict, out: Path) -> None:
    from olmo_core.nn.hf import save_hf_model
    from safetensors.torch import save_file

    module = train_module(spec)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in module.model.state_dict().items()}
    save_file(state, str(out / INIT_WEIGHTS))
    save_hf_model(out / HF_DIR, module.model.state_dict(), module.model)


def data_loader(spec: dict):
    """OLMo-core's NumpyFSLDataLoader over its NumpyFSLDataset of the stage's files, global batch in tokens."""
    from olmo_core.data import DataCollator, NumpyDataLoaderBase, NumpyFSLDataset

    dataset = NumpyFSLDataset(*spec["paths"], sequence_length=spec["seq_len"], pad_token_id=spec["pad"],
                              eos_token_id=spec["eos"], vocab_size=spec["vocab_size"],
                              dtype=np.dtype(spec["dtype"]).type,
                              metadata=[{"label": label} for label in spec["labels"]])
    dataset.work_dir = Path(spec["work_dir"])
    dataset.prepare()
    return NumpyDataLoaderBase.wrap_numpy_dataset(
        dataset, global_batch_size=spec["global_batch"] * spec["seq_len"],
        collator=DataCollator(pad_token_id=spec["pad"]), work_dir=spec["work_dir"], seed=spec["seed"], num_threads=0)


def lm_evaluator(spec: dict):
    """OLMo-core's LM evaluator callback over the held-out sets (one label each), OLMo's padded layout."""
    from olmo_core.data import NumpyPaddedFSLDatasetConfig, TokenizerConfig
    from olmo_core.train.callbacks import LMEvaluatorCallbackConfig

    names = list(spec["heldout"])
    return LMEvaluatorCallbackConfig(
        eval_dataset=NumpyPaddedFSLDatasetConfig(
            tokenizer=TokenizerConfig(vocab_size=spec["vocab_size"], eos_token_id=spec["eos"],
                                      pad_token_id=spec["pad"]),
            paths=[spec["heldout"][n] for n in names], metadata=[{"label": n} for n in names],
            sequence_length=spec["seq_len"], work_dir=spec["work_dir"]),
        eval_interval=spec["eval_every"], eval_on_startup=True, eval_on_finish=True)


def metrics_callback(path: str):
    from olmo_core.train.callbacks import Callback

    @dataclasses.dataclass
    class JsonlMetrics(Callback):
        """Every step's reduced metrics, appended as one JSON line ({"step": s, name: value, ...}), flushed at once so
        a killed run keeps what it logged."""

        path: str = ""

        def log_metrics(self, step: int, metrics: dict[str, float]):
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, **{k: float(v) for k, v in metrics.items()}}) + "\n")

    return JsonlMetrics(path=path)


def train(spec: dict) -> None:
    from olmo_core.train import TrainerConfig, prepare_training_environment, teardown_training_environment
    from olmo_core.train.callbacks import CheckpointerCallback, ConsoleLoggerCallback
    from olmo_core.train.common import Duration
    from safetensors.torch import load_file

    torch.set_num_threads(spec["threads"])
    prepare_training_environment(backend="gloo")  # one process: world size 1
    try:
        module = train_module(spec)
        if spec.get("init"):  # stage 1 starts from the weights `init` wrote (a resume overwrites them)
            module.model.load_state_dict(load_file(spec["init"]))
        stage2 = spec.get("load_path") is not None
        trainer = TrainerConfig(
            save_folder=spec["save_folder"], work_dir=spec["work_dir"], max_duration=Duration.steps(spec["steps"]),
            load_path=spec.get("load_path"), load_trainer_state=False if stage2 else None,
            load_optim_state=True if stage2 else None, metrics_collect_interval=1,
            callbacks={
                "checkpointer": CheckpointerCallback(save_interval=spec["checkpoint_every"],
                                                     pre_train_checkpoint=False),
                "console_logger": ConsoleLoggerCallback(metrics_log_interval=spec["log_every"]),
                "lm_evaluator": lm_evaluator(spec),
                "jsonl_metrics": metrics_callback(spec["metrics"]),
            },
        ).build(module, data_loader(spec))
        trainer.fit()
    finally:
        teardown_training_environment()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=("init", "train"))
    p.add_argument("--spec", required=True, help="the stage's JSON spec (written by bench/reference_run.py)")
    p.add_argument("--out", help="init: directory for init.safetensors and hf/")
    args = p.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    if args.command == "init":
        if not args.out:
            p.error("init needs --out")
        init(spec, Path(args.out))
    else:
        train(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
