"""The training loop: config -> mesh -> state (fresh, resumed or initialised from a checkpoint) -> steps.

Step numbering (DESIGN.md): step s (1-based) applies update s using global batch s-1 and logs its loss as
`step: s`; `checkpoints/N/` holds the state after N updates and a data state that consumed N batches.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "tiny.yaml"
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: interrupted by SIGTERM/SIGINT after writing a checkpoint; relaunch to resume
EXIT_NONFINITE = 3
EXIT_USAGE = 2

USAGE = """Train OLMo 3 with olmo3eqx. YAML gives the defaults, flags override any field.

Entry flags (before the others):
  --config PATH           YAML preset (default: configs/tiny.yaml)
  --simulated-devices N   run on N simulated CPU devices (for --dry-run planning of large meshes)
  --until-done            supervise: relaunch this command after a crash or preemption until it finishes
  --retry-backoff S       with --until-done: seconds to wait after a crash (default 300)
  --max-restarts N        with --until-done: give up after N relaunches (default 20)
"""
SUPERVISOR_FLAGS = {"--until-done": 0, "--retry-backoff": 1, "--max-restarts": 1}


def parse_args(argv: list[str] | None = None):
    """(TrainConfig, entry options): `--config` YAML defaults, then tyro flags over every field."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=str(DEFAULT_CONFIG))
    pre.add_argument("--simulated-devices", type=int, default=0)
    pre.add_argument("--until-done", action="store_true")
    pre.add_argument("--retry-backoff", type=float, default=300.0)
    pre.add_argument("--max-restarts", type=int, default=20)
    opts, rest = pre.parse_known_args(argv)
    if opts.simulated_devices:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={opts.simulated_devices}")
    import tyro

    from olmo3eqx.config import ConfigError, TrainConfig, load_yaml

    try:
        base = load_yaml(opts.config)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    try:
        cfg = tyro.cli(TrainConfig, default=base, args=rest, description=USAGE + f"\nDefaults from {opts.config}.")
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    return cfg, opts


def child_args(argv: list[str]) -> list[str]:
    """argv without the supervisor's own flags."""
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in SUPERVISOR_FLAGS:
            skip = SUPERVISOR_FLAGS[name] if "=" not in arg else 0
            continue
        out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg, opts = parse_args(argv)
    if opts.until_done:
        from olmo3eqx.supervise import run_until_done

        return run_until_done([sys.executable, "-m", "olmo3eqx.train", *child_args(argv)],
                              backoff_s=opts.retry_backoff, max_restarts=opts.max_restarts)
    from olmo3eqx import distributed
    from olmo3eqx.checkpoint import CheckpointLoadError
    from olmo3eqx.config import ConfigError
    from olmo3eqx.data import DataError

    try:
        distributed.initialize(cfg.dist)
        if cfg.dry_run:
            dry_run(cfg)
            return 0
        return train(cfg)
    except (ConfigError, DataError, CheckpointLoadError, FileNotFoundError) as e:
        # Bad input: one sentence naming the thing and the fix, not a traceback from deep inside.
        print(f"error{process_tag()}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except BaseException:
        tag = process_tag()
        if tag:  # which process failed, for logs interleaved from many hosts
            print(f"error{tag}: the exception below stopped this process", file=sys.stderr)
        raise


def process_tag() -> str:
    import jax

    try:
        return f" (process {jax.process_index()} of {jax.process_count()})" if jax.process_count() > 1 else ""
    except Exception:  # noqa: BLE001 - the backend itself may be what failed
        return ""


def dry_run(cfg) -> None:
    """Plan without building anything on devices: sizes, FLOPs, mesh, batch split, and the compiled step's
    memory per device from an ahead-of-time lowering over abstract arrays."""
    import jax
    import yaml

    from olmo3eqx import flops
    from olmo3eqx.config import to_dict
    from olmo3eqx.sharding import build_layout
    from olmo3eqx.step import make_train_step

    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    print("---")
    m, seq = cfg.model, cfg.data.seq_len
    layout = build_layout(cfg)
    plan = layout.plan
    per_token, per_token_all_global = flops.train_flops_per_token(m, seq), flops.train_flops_per_token(m, seq, False)
    device_step_tokens = plan.per_device_batch * plan.accum_steps * seq
    print(f"parameters:            {flops.param_count(m):,}")
    print(f"train FLOPs/token:     {per_token:.4e} (sliding windows counted as windowed); "
          f"{per_token_all_global:.4e} (MaxText convention, all layers global)")
    print(f"TFLOP per device-step: {per_token * device_step_tokens / 1e12:,.1f} windowed; "
          f"{per_token_all_global * device_step_tokens / 1e12:,.1f} all-global "
          f"({plan.per_device_batch * plan.accum_steps} x {seq} tokens per device)")
    print(f"devices:               {jax.device_count()} x {jax.devices()[0].device_kind} "
          f"({jax.process_count()} process(es))")
    print(f"mesh:                  {dict(layout.mesh.shape)}")
    print(f"batch:                 global {plan.global_batch} = {plan.batch_devices} data-parallel devices x "
          f"{plan.per_device_batch} per device x {plan.accum_steps} accumulation steps")
    step_fn = make_train_step(cfg, layout)
    t = time.perf_counter()
    compiled = step_fn.lower(layout.state_target(), *layout.batch_target(seq)).compile()
    compile_s = time.perf_counter() - t
    mem = compiled.memory_analysis()
    if mem is not None:
        state_bytes = mem.argument_size_in_bytes - mem.alias_size_in_bytes + mem.output_size_in_bytes
        gib = 1024**3
        print(f"compiled step memory per device: {(state_bytes + mem.temp_size_in_bytes) / gib:.2f} GiB "
              f"(arguments {mem.argument_size_in_bytes / gib:.2f}, outputs {mem.output_size_in_bytes / gib:.2f}, "
              f"aliased {mem.alias_size_in_bytes / gib:.2f}, temporaries {mem.temp_size_in_bytes / gib:.2f}); "
              f"compiled in {compile_s:.1f} s")
    else:
        print(f"compiled in {compile_s:.1f} s (this backend reports no memory analysis)")


class Preemption:
    """SIGTERM/SIGINT: finish the current step, write a checkpoint, exit with EXIT_PREEMPTED.

    With several processes, JAX's own preemption notifier (installed by `jax.distributed`) catches SIGTERM and the
    coordination service picks one step at which every process stops (`reached_preemption_sync_point`); a local
    handler would let processes stop at different steps and deadlock in the next collective."""

    def __init__(self, multiprocess: bool):
        self.multiprocess = multiprocess
        self.requested = None
        self._old = {}

    def __enter__(self):
        signals = (signal.SIGINT,) if self.multiprocess else (signal.SIGTERM, signal.SIGINT)
        for sig in signals:
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested is not None and signum == signal.SIGINT or self.multiprocess:
            raise KeyboardInterrupt  # a second Ctrl-C (or any Ctrl-C of one process of many) stops at once
        self.requested = signal.Signals(signum).name

    def check(self, step: int) -> str | None:
        """The signal to stop on after `step`, agreed by all processes; None to go on."""
        if self.multiprocess:
            from jax.experimental import multihost_utils

            return "SIGTERM" if multihost_utils.reached_preemption_sync_point(step) else None
        return self.requested

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def train(cfg) -> int:
    import jax

    from olmo3eqx import checkpoint as ckpt_lib
    from olmo3eqx import data as data_lib
    from olmo3eqx import flops, metrics
    from olmo3eqx.config import dump_yaml, to_dict
    from olmo3eqx.sharding import build_layout
    from olmo3eqx.step import make_train_step

    primary = jax.process_index() == 0
    run_dir = cfg.run_dir
    if primary:
        run_dir.mkdir(parents=True, exist_ok=True)
        dump_yaml(cfg, run_dir / "config.yaml")
    log = metrics.MetricsLogger(run_dir, cfg.log, cfg.steps, enabled=primary, config_dict=to_dict(cfg))
    say = log.print if primary else (lambda m: None)
    from olmo3eqx import distributed, hostmem

    say(distributed.describe())
    say(hostmem.describe())

    layout = build_layout(cfg)
    say(layout.describe())

    checkpointer = ckpt_lib.Checkpointer(run_dir / "checkpoints", keep=cfg.checkpoint.keep,
                                         keep_every=cfg.checkpoint.keep_every, async_save=cfg.checkpoint.async_save)
    resumed = checkpointer.restore_latest(layout.state_target(), cfg.model, warn=say)
    if resumed is not None:
        start, state, data_state = resumed
        say(f"resumed from {checkpointer.directory / str(start)}")
    else:
        start, data_state = 0, None
        state = layout.init_state(cfg)
        if cfg.init_from:
            state = ckpt_lib.init_from(cfg.init_from, state, layout.state_target(), with_optimizer=cfg.init_optimizer)
            say(f"initialised from {cfg.init_from} ({'weights + moments' if cfg.init_optimizer else 'weights'})")
    if start >= cfg.steps:
        say(f"checkpoint step {start} already reaches steps={cfg.steps}: nothing to do.")
        checkpointer.close()
        log.close()
        return 0

    data_it = data_lib.build_train_iterator(
        cfg.data, seq_len=cfg.data.seq_len, global_batch=cfg.data.global_batch, seed=cfg.run.seed,
        shard_index=jax.process_index(), shard_count=jax.process_count(), vocab_size=cfg.token_vocab_size,
        state=data_state)
    if data_it.batches_consumed != start:
        raise SystemExit(f"error: the data state of checkpoint {start} has consumed {data_it.batches_consumed} "
                         f"batches instead of {start}; the checkpoint is inconsistent.")

    train_step = make_train_step(cfg, layout)

    flops_per_token = flops.train_flops_per_token(cfg.model, cfg.data.seq_len)
    peak = flops.peak_flops(jax.devices()[0])
    tokens_per_step = cfg.data.global_batch * cfg.data.seq_len
    config_dict = to_dict(cfg)

    def save(step: int) -> None:
        checkpointer.save(step, state, data_it.get_state(), config_dict)

    from olmo3eqx import evals

    # Held-out sets and task files are opened and checked here, before the first step.
    evaluate_model, heldout_names = None, []
    if cfg.eval.every:
        evaluate_model, heldout_names = evals.build_evaluator(
            cfg.eval, cfg.data, cfg.model, mesh=layout.mesh, model_shardings=layout.shardings.model,
            batch_size=layout.plan.micro_batch,
            seq_len=cfg.data.seq_len, max_instances=cfg.eval.batches * cfg.data.global_batch)

    watcher = MemorisationWatch(cfg.eval.memorisation_gap)
    timer = {"time": None, "step": start}

    def report(p: metrics.PendingMetrics) -> int:
        """Fetch step p's metrics; log them every log.every steps; EXIT_NONFINITE on a NaN/Inf loss."""
        values = p.result()
        if not (math.isfinite(values["train/loss"]) and math.isfinite(values["train/grad_norm"])):
            kept = checkpointer.steps()
            say(f"error: non-finite loss or gradient norm at step {p.step} (loss {values['train/loss']}, grad norm "
                f"{values['train/grad_norm']}); stopping. The last good checkpoint is "
                f"{checkpointer.directory / str(kept[-1]) if kept else 'none'}: lower optim.lr, enable "
                f"optim.spike_guard, or inspect the data around batch {p.step - 1}.")
            return EXIT_NONFINITE
        watcher.add_train(values["train/loss"])
        if p.step % cfg.log.every == 0 or p.step == cfg.steps or p.step == start + 1:
            now = time.perf_counter()
            values["train/tokens"] = p.step * tokens_per_step
            if timer["time"] is not None and p.step > timer["step"]:
                tps = (p.step - timer["step"]) * tokens_per_step / (now - timer["time"])
                values["perf/tokens_per_s"] = tps
                values["perf/tflops_per_device"] = tps * flops_per_token / jax.device_count() / 1e12
                m = flops.mfu(tps, flops_per_token, jax.device_count(), peak)
                if m is not None:
                    values["perf/mfu"] = m
            timer["time"], timer["step"] = now, p.step
            log.log(p.step, values)
        return 0

    index_log = None
    if cfg.log.indices:  # which data this run saw, per process (appends across resumes, like metrics.jsonl)
        (run_dir / "indices").mkdir(parents=True, exist_ok=True)
        index_log = open(run_dir / "indices" / f"process_{jax.process_index()}.jsonl", "a", buffering=1)
    if start == 0 and evaluate_model is not None:  # the starting point of the held-out curves, as step 0
        ev = evaluate_model(state.model)
        log.log(0, ev)
        say(f"eval step 0: {evals.summary(ev)}")
    pending = None
    status = 0
    step = start
    with Preemption(jax.process_count() > 1) as preempt:
        try:
            for step in range(start + 1, cfg.steps + 1):
                batch = next(data_it)
                if index_log is not None:
                    index_log.write(json.dumps({"step": step, "index": batch["index"].tolist()}) + "\n")
                state, step_metrics = train_step(state, *layout.put_batch(batch))
                current = metrics.PendingMetrics(step, step_metrics)
                if pending is not None:  # step t's metrics are read after step t+1 is dispatched
                    status = report(pending)
                    if status:
                        break
                pending = current
                stop = preempt.check(step)
                boundary = step % cfg.checkpoint.every == 0 or step == cfg.steps or stop
                eval_due = cfg.eval.every and (step % cfg.eval.every == 0 or step == cfg.steps)
                if boundary or eval_due:
                    status = report(pending)  # never checkpoint or evaluate a non-finite state
                    pending = None
                    if status:
                        break
                if eval_due:
                    ev = evaluate_model(state.model)
                    log.log(step, ev)
                    say(f"eval step {step}: {evals.summary(ev)}")
                    warning = watcher.update(ev[f"eval/{heldout_names[0]}/loss"])
                    if warning:
                        say(warning)
                if boundary:
                    save(step)
                if stop:
                    say(f"{stop} received: checkpoint {step} written; exiting to be resumed.")
                    status = EXIT_PREEMPTED
                    break
            if pending is not None and not status:
                status = report(pending)
        finally:
            if index_log is not None:
                index_log.close()
            checkpointer.close()
            log.close()
    return status


class MemorisationWatch:
    """The reproduction's signature: training loss well below held-out loss for a sustained window."""

    def __init__(self, gap: float, window: int = 3):
        self.gap, self.window = gap, window
        self.train_losses: list[float] = []
        self.gaps: list[float] = []

    def add_train(self, loss: float) -> None:
        self.train_losses = (self.train_losses + [loss])[-20:]

    def update(self, heldout: float) -> str | None:
        if not self.train_losses:
            return None
        train = sum(self.train_losses) / len(self.train_losses)
        self.gaps = (self.gaps + [heldout - train])[-self.window:]
        if len(self.gaps) == self.window and min(self.gaps) > self.gap:
            return (f"warning: train loss has been more than {self.gap} below held-out loss for {self.window} "
                    f"evaluations (now {train:.4f} vs {heldout:.4f}): memorisation, or repeated data?")
        return None


if __name__ == "__main__":
    from olmo3eqx.hostmem import reexec_with_caching_malloc

    reexec_with_caching_malloc()  # as train.py does (olmo3eqx/hostmem.py); jax is not imported yet
    sys.exit(main())
