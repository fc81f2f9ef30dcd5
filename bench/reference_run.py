"""The reproduction in miniature: a whole run of ours beside OLMo-core's own Trainer, stage 1 then the stage-2 anneal
from each side's own checkpoint, curves overlaid, each side killed and resumed, then once more with a data fault.

    python bench/reference_run.py                                    # the full run (docs/reproduction.md)
    python bench/reference_run.py --steps 300 --stage2-steps 300     # the short version (.ci/run)
    python bench/reference_run.py --out docs/reproduction            # the run the docs show

Everything runs as a user would run it, each side in its own processes (up to --jobs at a time):
1. data: the default corpus (CPython 3.11.7's standard library, byte-tokenized; its documents and held-out split):
   stage 1's mix is code, exactly one epoch of the stage's batches; stage 2's mix adds prose (the language
   reference of its pydoc_data) to unseen code; two held-out sets, code and prose, one document of seq_len tokens each.
2. init: OLMo-core builds and initialises its olmo3_14M shape (bench/reference_olmo_core.py init) and exports it
   with save_hf_model; `convert.py hf-to-orbax` converts it: both sides start from the same weights.
3. stage 1: `python train.py --config ours-stage1.yaml` and OLMo-core's Trainer (reference_olmo_core.py train), AI2's
   recipe numbers on both (AdamW with float32 moments, peak LR 3e-4, warmup then cosine, z-loss, clipping, spike
   skipping, no decay on the embedding), the same batches (data.order olmo-core); each is killed with SIGKILL once
   past its mid-run checkpoint and relaunched: ours resumes from its checkpoint, OLMo-core's Trainer from its save
   folder.
4. stage 2: each side from its own last stage-1 checkpoint (weights and AdamW moments; step and data fresh), the
   second mix, AI2's stage-2 peak LR 2.0712e-4, linear to 0; killed and resumed once likewise.
5. fault: ours again through both stages with a double-sharded loader (bench/reference_fault.py: every record read
   8 times), against the same OLMo-core run, and `olmo3eqx-compare` on each pair.
Written to --out: reference_run.json (every per-step series, gaps, their distribution, the resumes, the verdicts,
the gates, the costs) and reference_run.png. Printed: the table of gaps and the gates (GATES; read while both sides
apply the same updates, see gaps). Exit 0 when every gate holds, 1 when one does not or a side fails (its log's end
printed), 2 on bad input. Training leaves --work/jobs.json; report(work, out) makes the outputs again from it without
training.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))

from common import RESULTS, machine, table  # noqa: E402

from olmo3eqx import exits  # noqa: E402

OUT = RESULTS / "reference_run"

# OLMo's byte tokenizer of the default corpus (olmo3eqx.data.prepare): 256 bytes, EOS, PAD; the model's embedding
# is padded to a multiple of 128, as OLMo pads dolma2's 100,278 to 100,352.
VOCAB, EOS, PAD, MODEL_VOCAB = 258, 256, 257, 384
TOKEN_DTYPE = "uint16"
TOKENIZER_DIR = "allenai/dolma2-tokenizer"
"""Where `{TOKENIZER}` of a mix file points (olmo3eqx.data.mixes: a mix file not named after one of AI2's)."""
STAGE1_SEED, STAGE2_SEED = 34521, 1337
"""AI2's data seeds of stage 1 (OLMo-3-1025-7B-pretrain-1.py) and stage 2 (midtrain.py)."""
STAGE2_LR = 2.0712352850360292e-4
"""AI2's stage-2 peak LR (midtrain.py); stage 1's is OptimConfig's default, AI2's 3e-4."""
PROSE_SOURCE = "pydoc_data/topics.py"
"""The language reference's text in the standard library: stage 2's prose, kept out of the code."""
PROSE_HELDOUT_EVERY = 8
"""Every 8th topic of the language reference (in name order) is held out."""

GATES = {"train_loss_rel": 1e-4, "heldout": 1e-4}
"""Clean run, while both sides apply the same updates (gaps): the largest per-step relative training-loss gap
|ours - OLMo-core| / OLMo-core of either stage, and the largest held-out gap (nats) of any set and evaluation. Why
these sizes: docs/reproduction.md."""

OLMO_CORE_NAMES = {"train/CE loss": "train/loss", "train/Z loss": "train/z_loss",
                   "optim/total grad norm": "train/grad_norm", "optim/LR (group 0)": "train/lr",
                   "optim/step skipped": "train/skipped"}
"""OLMo-core's metric -> ours; its held-out `eval/lm/<set>/CE loss` becomes eval/<set>/loss, times
olmo_core_heldout_scale."""
HELDOUT_SETS = ("code", "prose")
TRAIN = ("train/loss", "train/z_loss", "train/grad_norm", "train/lr", "train/skipped")


@dataclass(frozen=True)
class Plan:
    """The run's sizes: OLMo-core's olmo3_14M shape (d_model 128, 4 layers, 8 heads) over a byte vocabulary."""

    steps: int = 2000
    stage2_steps: int = 2000
    seq_len: int = 128
    global_batch: int = 8
    window: int = 32
    warmup_fraction: float = 0.05
    eval_every: int = 100
    heldout_docs: int = 256
    shards: int = 8
    """Processes the fault's double sharding simulates (one instance each at global batch 8): each record 8 times."""
    kill_fraction: float = 0.6
    """Each side is killed once per stage after this fraction of the steps (past the checkpoint of step 2/4)."""
    threads: int = 1
    """torch threads of OLMo-core's side."""

    def stage_steps(self, stage: int) -> int:
        return self.steps if stage == 1 else self.stage2_steps

    def checkpoint_every(self, stage: int) -> int:
        return max(1, self.stage_steps(stage) // 4)

    def kill_at(self, stage: int) -> int:
        return max(self.checkpoint_every(stage) + 1, round(self.kill_fraction * self.stage_steps(stage)))

    def optim(self, stage: int) -> dict:
        """Our OptimConfig fields of the stage; the rest are OptimConfig's defaults, AI2's numbers (peak LR 3e-4, betas,
        eps, weight decay, clipping, z-loss, the spike guard's window and sigma). Stage 1: warmup (a twentieth of the
        run) and one cosine to 0.1 x the peak; stage 2: AI2's stage-2 peak, no warmup, linear to 0."""
        if stage == 1:
            return {"warmup_steps": max(1, round(self.warmup_fraction * self.steps)), "schedule": "cosine",
                    "final_lr_ratio": 0.1, "spike_guard": True}
        return {"lr": STAGE2_LR, "warmup_steps": 0, "schedule": "linear", "final_lr_ratio": 0.0, "spike_guard": True}


# --- data ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Data:
    mixes: dict[int, Path]  # stage -> mix file
    root: Path  # the mixes' data root
    files: dict[int, list[tuple[str, str]]]  # stage -> (label, token file) in mix order
    heldout: dict[str, Path]  # set -> token file of seq_len-token documents


def documents() -> tuple[list[bytes], list[bytes], list[bytes], list[bytes]]:
    """(training code, held-out code, training prose, held-out prose): the default corpus's standard-library files
    (read from the archive the package ships, its held-out split kept), the language reference taken out of them
    and split into its topics."""
    import runpy
    import tempfile

    from olmo3eqx.data.corpus import HELDOUT_FRACTION, extract_text
    from olmo3eqx.data.prepare import is_heldout

    code, heldout_code, topics = [], [], {}
    with tempfile.TemporaryDirectory() as text:
        for piece in extract_text(text):
            if piece.doc_id == PROSE_SOURCE:
                topics = runpy.run_path(piece.path)["topics"]
            else:
                is_out = is_heldout(piece.doc_id, HELDOUT_FRACTION)
                (heldout_code if is_out else code).append(Path(piece.path).read_bytes())
    names = sorted(topics)
    prose = [topics[n].encode() for i, n in enumerate(names) if i % PROSE_HELDOUT_EVERY]
    heldout_prose = [topics[n].encode() for i, n in enumerate(names) if not i % PROSE_HELDOUT_EVERY]
    return code, heldout_code, prose, heldout_prose


def tokens(texts: list[bytes]) -> np.ndarray:
    from olmo3eqx.data.prepare import BYTES, tokenize_documents

    return tokenize_documents(texts, tokenizer=BYTES, eos_id=EOS, dtype=TOKEN_DTYPE)


def heldout_documents(texts: list[bytes], plan: Plan) -> np.ndarray:
    """`plan.heldout_docs` documents of seq_len tokens (seq_len - 1 bytes and EOS), evenly spaced over the texts: OLMo's
    padded layout scores each whole, so every scored token sees the same context on both sides."""
    body = np.concatenate([np.frombuffer(t, np.uint8) for t in texts]).astype(TOKEN_DTYPE)
    pieces = body[: body.size // (plan.seq_len - 1) * (plan.seq_len - 1)].reshape(-1, plan.seq_len - 1)
    if len(pieces) < plan.heldout_docs:
        raise ValueError(f"The held-out text makes {len(pieces)} documents of {plan.seq_len} tokens, fewer than "
                         f"--heldout-docs {plan.heldout_docs}; lower it.")
    chosen = pieces[np.linspace(0, len(pieces) - 1, plan.heldout_docs).round().astype(int)]
    return np.concatenate([chosen, np.full((len(chosen), 1), EOS, TOKEN_DTYPE)], axis=1).reshape(-1)


def prepare_data(plan: Plan, work: Path) -> Data:
    """Stage 1's mix: code, exactly `steps` global batches (one epoch). Stage 2's mix: prose (a quarter of its tokens
    at most) and the code after stage 1's, exactly `stage2_steps` batches together. Held-out: code and prose."""
    code, heldout_code, prose, heldout_prose = documents()
    root = work / "data"
    batch_tokens = plan.seq_len * plan.global_batch
    code_tokens, prose_tokens = tokens(code), tokens(prose)
    n1, n2 = plan.steps * batch_tokens, plan.stage2_steps * batch_tokens
    n2_prose = min(prose_tokens.size, n2 // 4) // plan.seq_len * plan.seq_len
    if code_tokens.size < n1 + n2 - n2_prose:
        raise ValueError(f"The standard library holds {code_tokens.size:,} code tokens, fewer than the "
                         f"{n1 + n2 - n2_prose:,} the two stages read; lower --steps or --stage2-steps.")
    parts = {1: [("code", code_tokens[:n1])],
             2: [("code", code_tokens[n1:n1 + n2 - n2_prose]), ("prose", prose_tokens[:n2_prose])]}
    mixes, files = {}, {}
    for stage, members in parts.items():
        lines, files[stage] = [], []
        for label, array in members:
            rel = f"stage{stage}/{label}.npy"
            path = root / TOKENIZER_DIR / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            array.tofile(path)
            lines.append(f"{label},{{TOKENIZER}}/{rel}")
            files[stage].append((label, str(path)))
        mixes[stage] = root / f"stage{stage}-mix.txt"
        mixes[stage].write_text("\n".join(lines) + "\n")
    heldout = {}
    for name, texts in zip(HELDOUT_SETS, (heldout_code, heldout_prose)):
        heldout[name] = root / "heldout" / f"{name}.npy"
        heldout[name].parent.mkdir(parents=True, exist_ok=True)
        heldout_documents(texts, plan).tofile(heldout[name])
    return Data(mixes, root, files, heldout)


def olmo_core_heldout_scale(plan: Plan) -> float:
    """OLMo-core's LMEvaluator averages over every real token of a document, the last one (no label, loss 0)
    included: n tokens for n - 1 predictions (OLMO_CORE.md); ours averages over the predictions. Every held-out
    document here has seq_len tokens, so its number times seq_len / (seq_len - 1) is ours."""
    return plan.seq_len / (plan.seq_len - 1)


# --- the two sides' configurations -----------------------------------------------------------------


def our_config(plan: Plan, stage: int, data: Data, name: str, runs: Path, init_from: str, model: dict) -> dict:
    """train.py's YAML for one stage: the converted model, the stage's mix in OLMo-core's order, the recipe numbers."""
    return {
        "run": {"name": name, "dir": str(runs)},
        "steps": plan.stage_steps(stage),
        "init_from": init_from,
        "init_optimizer": stage == 2,
        "model": model,
        "data": {"mix": str(data.mixes[stage]), "mix_root": str(data.root), "order": "olmo-core",
                 "seed": STAGE1_SEED if stage == 1 else STAGE2_SEED, "seq_len": plan.seq_len,
                 "global_batch": plan.global_batch, "token_dtype": TOKEN_DTYPE, "vocab_size": VOCAB},
        "optim": plan.optim(stage),
        "mesh": {"fsdp": 1, "max_per_device_batch": plan.global_batch},
        "checkpoint": {"every": plan.checkpoint_every(stage), "keep": 8},
        "eval": {"every": plan.eval_every, "batches": 0, "heldout_instances": "document",
                 "heldout": [f"{n}={p}" for n, p in data.heldout.items()]},
        "log": {"every": 1, "progress": False, "tensorboard": False},
    }


def olmo_core_spec(plan: Plan, stage: int, data: Data, side_dir: Path, init: Path | None, load_path: Path | None,
                   optim: dict) -> dict:
    """reference_olmo_core.py's spec for one stage: the same numbers, OLMo-core's names."""
    return {
        "steps": plan.stage_steps(stage), "save_folder": str(side_dir / f"stage{stage}"),
        "work_dir": str(side_dir / "work"), "metrics": str(side_dir / f"stage{stage}.jsonl"),
        "init": None if init is None else str(init), "load_path": None if load_path is None else str(load_path),
        "paths": [p for _, p in data.files[stage]], "labels": [label for label, _ in data.files[stage]],
        "heldout": {n: str(p) for n, p in data.heldout.items()},
        "seq_len": plan.seq_len, "global_batch": plan.global_batch, "window": plan.window,
        "vocab_size": VOCAB, "model_vocab_size": MODEL_VOCAB, "eos": EOS, "pad": PAD, "dtype": TOKEN_DTYPE,
        "seed": STAGE1_SEED if stage == 1 else STAGE2_SEED, "optim": optim,
        "eval_every": plan.eval_every, "checkpoint_every": plan.checkpoint_every(stage), "log_every": 100,
        "threads": plan.threads,
    }


def full_optim(plan: Plan, stage: int) -> dict:
    """OptimConfig with the stage's fields, as a dict: every number both sides are configured with."""
    from olmo3eqx.config import OptimConfig, to_dict

    return to_dict(OptimConfig(**plan.optim(stage)))


# --- processes -------------------------------------------------------------------------------------


def child_env() -> dict[str, str]:
    """This environment without simulated CPU devices (a test suite's): each side runs on one device, as on a host."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags)
    return env


@dataclass
class Job:
    """One side of one stage: a command run to completion, killed once with SIGKILL when its metrics reach
    `kill_at` and relaunched (the same command resumes it)."""

    name: str
    command: list[str]
    metrics: Path
    log: Path
    kill_at: int | None = None
    after: tuple[str, ...] = ()
    proc: subprocess.Popen | None = None
    started: float = 0.0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    launches: int = 0
    killed_at_line: int | None = None  # metrics lines written before the kill
    killed_at_step: int | None = None

    def launch(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as log:
            log.write(f"\n$ {' '.join(self.command)}\n")
            log.flush()
            # A session of its own: the kill reaches every process of the side and nothing else.
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                         start_new_session=True, env=child_env())
        self.started = time.monotonic()
        self.launches += 1

    def reap(self, options: int = os.WNOHANG) -> int | None:
        """The exit code once the process has ended (its CPU time added), else None."""
        pid, status, usage = os.wait4(self.proc.pid, options)
        if pid == 0:
            return None
        self.wall_s += time.monotonic() - self.started
        self.cpu_s += usage.ru_utime + usage.ru_stime
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        return self.proc.returncode

    def last_step(self) -> tuple[int, int]:
        """(complete lines, the largest training step in them) of the metrics file so far; a line still being written
        (or torn by the kill, which the relaunched writer drops) is not counted."""
        if not self.metrics.is_file():
            return 0, 0
        lines = self.metrics.read_text().split("\n")[:-1]
        records = map(json.loads, lines)
        steps = [0] + [int(rec["step"]) for rec in records if "train/loss" in rec or "train/CE loss" in rec]
        return len(lines), max(steps)

    def kill_if_due(self) -> None:
        if self.kill_at is None or self.killed_at_step is not None:
            return
        lines, step = self.last_step()
        if step >= self.kill_at:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.reap(0)
            self.killed_at_line, self.killed_at_step = self.last_step()
            print(f"  {self.name}: killed (SIGKILL) after step {self.killed_at_step}; relaunched", flush=True)
            self.launch()


def run_jobs(jobs: list[Job], max_jobs: int, timeout_s: float) -> None:
    """Run `jobs` (each after the jobs it names), at most `max_jobs` at once, killing each once as it asks; a job that
    fails stops everything with its log's tail."""
    pending, running, done = list(jobs), [], set()
    start = time.monotonic()
    while pending or running:
        for job in [j for j in pending if all(a in done for a in j.after)][:max(0, max_jobs - len(running))]:
            pending.remove(job)
            print(f"  {job.name}: started", flush=True)
            job.launch()
            running.append(job)
        time.sleep(1.0)
        for job in list(running):
            job.kill_if_due()
            rc = job.reap()
            if rc is None:
                if time.monotonic() - start > timeout_s:
                    for j in running:
                        os.killpg(j.proc.pid, signal.SIGKILL)
                        j.reap(0)
                    raise RuntimeError(f"{job.name} still running after --timeout {timeout_s:.0f} s; log: {job.log}")
                continue
            running.remove(job)
            if rc != 0:
                for j in running:
                    os.killpg(j.proc.pid, signal.SIGKILL)
                    j.reap(0)
                tail = "\n".join(job.log.read_text().splitlines()[-25:])
                raise RuntimeError(f"{job.name} exited with {rc}; the end of {job.log}:\n{tail}")
            done.add(job.name)
            print(f"  {job.name}: done in {job.wall_s:.0f} s ({job.cpu_s:.0f} CPU s)", flush=True)


# --- reading the runs ------------------------------------------------------------------------------


@dataclass
class Curves:
    """One side of one stage: per-step training series and per-evaluation held-out losses (the last record of a step
    wins), and what its resume replayed."""

    steps: np.ndarray
    train: dict[str, np.ndarray]
    eval_steps: np.ndarray
    heldout: dict[str, np.ndarray]
    replayed: dict = field(default_factory=dict)


def records_of(path: Path, olmo_core_scale: dict[str, float] | None) -> list[dict]:
    """The metrics records under our names; OLMo-core's are renamed and its held-out means made per prediction."""
    from olmo3eqx.metrics import read_metrics

    out = []
    for rec in read_metrics(path):
        if olmo_core_scale is None:
            out.append(rec)
            continue
        mapped = {"step": rec["step"]}
        for k, v in rec.items():
            if k in OLMO_CORE_NAMES:
                mapped[OLMO_CORE_NAMES[k]] = v
            elif k.startswith("eval/lm/") and k.endswith("/CE loss"):
                name = k[len("eval/lm/"):-len("/CE loss")]
                mapped[f"eval/{name}/loss"] = v * olmo_core_scale[name]
        out.append(mapped)
    return out


def curves(records: list[dict], steps: int, sets: list[str], killed_at_line: int | None) -> Curves:
    by_step: dict[int, dict] = {}
    for rec in records:
        by_step.setdefault(int(rec["step"]), {}).update({k: v for k, v in rec.items() if isinstance(v, (int, float))})
    missing = [s for s in range(1, steps + 1) if "train/loss" not in by_step.get(s, {})]
    if missing:
        raise ValueError(f"{len(missing)} training steps have no record (the first: {missing[0]}).")
    train = {k: np.array([by_step[s].get(k, 0.0) for s in range(1, steps + 1)], np.float64) for k in TRAIN}
    eval_steps = np.array(sorted(s for s, r in by_step.items() if all(f"eval/{n}/loss" in r for n in sets)))
    heldout = {n: np.array([by_step[s][f"eval/{n}/loss"] for s in eval_steps]) for n in sets}
    return Curves(np.arange(1, steps + 1), train, eval_steps, heldout, replay(records, killed_at_line))


def replay(records: list[dict], killed_at_line: int | None) -> dict:
    """What the relaunch after the kill logged again: the steps logged both before the kill and after it, the largest
    difference of their training losses (0 when the resume is exact), and the first of them whose loss or skip decision
    differs from the uninterrupted run's (None when none does)."""
    if killed_at_line is None:
        return {}
    before = {int(r["step"]): r for r in records[:killed_at_line] if "train/loss" in r}
    after = [r for r in records[killed_at_line:] if "train/loss" in r]
    first = min(int(r["step"]) for r in after)
    again = {int(r["step"]): r for r in after if int(r["step"]) in before}
    differing = [s for s, r in sorted(again.items()) if r["train/loss"] != before[s]["train/loss"]
                 or r.get("train/skipped", 0) != before[s].get("train/skipped", 0)]
    return {"killed_after_step": max(before), "resumed_from_step": first - 1, "steps_replayed": len(again),
            "max_abs_loss_diff": max((abs(r["train/loss"] - before[s]["train/loss"]) for s, r in again.items()),
                                     default=0.0),
            "first_differing_step": differing[0] if differing else None}


# --- gaps, gates, verdicts -------------------------------------------------------------------------


def gaps(ours: Curves, ref: Curves) -> dict:
    """Per-step and per-evaluation gaps of `ours` against `ref`, and the table's numbers. The gates read the part of the
    run in which both sides applied the same updates: up to the first step one side's spike guard skipped and the
    other's did not (from the next step on they train different weights; `same_updates_through`, the last step of
    that part, is the run's last step when no such step exists)."""
    rel = {k: (ours.train[k] - ref.train[k]) / np.abs(ref.train[k]) for k in ("train/loss", "train/grad_norm")}
    peak = np.abs(ref.train["train/lr"]).max()  # the LR is 0 at stage 2's end: gaps over the peak
    rel["train/lr"] = (ours.train["train/lr"] - ref.train["train/lr"]) / peak
    common, io, ir = np.intersect1d(ours.eval_steps, ref.eval_steps, return_indices=True)
    held = {n: ours.heldout[n][io] - ref.heldout[n][ir] for n in ours.heldout}
    a = np.abs(rel["train/loss"])
    skips = {side: [int(s) + 1 for s in np.flatnonzero(c.train["train/skipped"])]
             for side, c in (("ours", ours), ("olmo_core", ref))}
    disagree = sorted(set(skips["ours"]) ^ set(skips["olmo_core"]))
    through = disagree[0] if disagree else len(a)  # the loss of that step is still the same weights'
    same = common < through  # evaluations after an update both applied
    return {
        "train_loss_rel": rel["train/loss"], "grad_norm_rel": rel["train/grad_norm"], "lr_rel": rel["train/lr"],
        "eval_steps": common, "heldout": held,
        "summary": {
            "skipped": skips, "skip_disagreements": disagree, "same_updates_through": through,
            "train_loss_rel_max": float(a[:through].max()), "train_loss_rel_max_step": int(a[:through].argmax()) + 1,
            "train_loss_rel_max_all": float(a.max()), "train_loss_rel_final": float(a[-1]),
            "train_loss_rel_quantiles": {q: float(np.quantile(a[:through], float(q))) for q in ("0.5", "0.9", "0.99")},
            "train_loss_rel_max_by_quarter": [float(x.max()) for x in np.array_split(a, 4)],
            "grad_norm_rel_max": float(np.abs(rel["train/grad_norm"][:through]).max()),
            "lr_rel_max": float(np.abs(rel["train/lr"]).max()),
            "heldout_max": {n: float(np.abs(g[same]).max(initial=0.0)) for n, g in held.items()},
            "heldout_final": {n: float(g[-1]) for n, g in held.items()},
            "train_loss_last_quarter_mean_gap": float(np.mean((ours.train["train/loss"] - ref.train["train/loss"])
                                                              [-len(a) // 4:])),
            "heldout_last": {n: {"ours": float(ours.heldout[n][io][-1]), "olmo_core": float(ref.heldout[n][ir][-1])}
                             for n in held},
        },
    }


def as_run_dir(c: Curves, path: Path) -> Path:
    """A side's curves as a run directory olmo3eqx-compare reads (metrics.jsonl under our names)."""
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "metrics.jsonl", "w") as f:
        for i, s in enumerate(c.steps):
            f.write(json.dumps({"step": int(s), "time": 0.0, "train/loss": float(c.train["train/loss"][i])}) + "\n")
        for j, s in enumerate(c.eval_steps):
            f.write(json.dumps({"step": int(s), "time": 0.0,
                                **{f"eval/{n}/loss": float(v[j]) for n, v in c.heldout.items()}}) + "\n")
    return path


def verdict(a: Path, b: Path, png: Path, windows: int) -> dict:
    """`olmo3eqx-compare A B --windows W`: its printout, which run (if any) it says shows the memorisation signature
    in the last window, which it rates better there, and the runs it names in earlier windows."""
    out = subprocess.run([sys.executable, "-m", "olmo3eqx.tools.compare", str(a), str(b), "--out", str(png),
                          "--windows", str(windows)], capture_output=True, text=True, cwd=REPO, env=child_env())
    if out.returncode != 0:
        raise RuntimeError(f"olmo3eqx-compare failed ({out.returncode}): {out.stderr.strip()}")
    lines = out.stdout.splitlines()
    last = next(line for line in lines if line.startswith(("MEMORISATION SIGNATURE in run", "no memorisation")))
    earlier = [line for line in lines if line.startswith("earlier, MEMORISATION SIGNATURE in run")]
    flagged = "A" if "SIGNATURE in run A" in last else "B" if "SIGNATURE in run B" in last else None
    better = next((run for run in "AB" if f"run {run}'s train loss" in last), None) if "real improvement" in last \
        else None
    return {"flagged": flagged, "better": better, "line": last, "earlier": earlier,
            "earlier_flagged": sorted({line.split("in run ")[1][0] for line in earlier}), "printout": out.stdout}


def compare_windows(plan: Plan, stage: int) -> int:
    """olmo3eqx-compare's windows for a stage: one per held-out evaluation, so an episode as short as the interval
    between two evaluations (the fault's head start, ~100 steps) is judged on its own."""
    return max(1, plan.stage_steps(stage) // plan.eval_every)


def check_gates(clean: dict[int, dict], replays: dict[int, dict], fault: dict | None) -> dict[str, dict]:
    """Each gate: its limit, what the run shows, and whether it holds. `replays`: OLMo-core's resume of each stage."""
    train = max(g["summary"]["train_loss_rel_max"] for g in clean.values())
    held = max(v for g in clean.values() for v in g["summary"]["heldout_max"].values())
    out = {"train_loss_rel": {"limit": GATES["train_loss_rel"], "seen": train,
                              "holds": train <= GATES["train_loss_rel"]},
           "heldout": {"limit": GATES["heldout"], "seen": held, "holds": held <= GATES["heldout"]}}
    # A skip decision the sides disagree on is OLMo-core's resume when its resumed run disagrees with its own
    # uninterrupted one at that very step: its spike guard's history is not checkpointed, ours is.
    unexplained = {stage: g["summary"]["skip_disagreements"][0] for stage, g in clean.items()
                   if g["summary"]["skip_disagreements"]
                   and replays[stage].get("first_differing_step") != g["summary"]["skip_disagreements"][0]}
    seen = {stage: g["summary"]["skip_disagreements"] for stage, g in clean.items()}
    out["skips"] = {"limit": "the same steps skipped, but where OLMo-core's resumed run skips differently from its own "
                             "uninterrupted run", "seen": seen, "holds": not unexplained}
    if fault is not None:
        gaps = [v for g in fault["gaps"].values() for v in g["summary"]["heldout_final"].values()]
        out["fault_heldout"] = {"limit": f"every final held-out gap of the faulty run > {GATES['heldout']}",
                                "seen": min(gaps), "holds": min(gaps) > GATES["heldout"]}
        verdicts = list(fault["verdicts"].values())
        out["fault_verdict"] = {
            "limit": "olmo3eqx-compare names the faulty run's (A's) memorisation signature in some window of some "
                     "stage, and at each stage's end flags it or rates OLMo-core's (B) the better one",
            "seen": " | ".join([*(e for v in verdicts for e in v["earlier"]), *(v["line"] for v in verdicts)]),
            "holds": any(v["flagged"] == "A" or "A" in v["earlier_flagged"] for v in verdicts)
            and all(v["flagged"] == "A" or v["better"] == "B" for v in verdicts)}
    return out


# --- report ----------------------------------------------------------------------------------------


def gap_table(clean: dict[int, dict], fault: dict | None) -> str:
    rows = []
    for label, by_stage in (("clean", clean), ("fault", None if fault is None else fault["gaps"])):
        for stage, g in (by_stage or {}).items():
            s = g["summary"]
            rows.append({
                "run": label, "stage": stage,
                "max": f"{s['train_loss_rel_max']:.2e} (step {s['train_loss_rel_max_step']})",
                "final": f"{s['train_loss_rel_final']:.2e}",
                "p50/p99": f"{s['train_loss_rel_quantiles']['0.5']:.1e} / {s['train_loss_rel_quantiles']['0.99']:.1e}",
                "last quarter": f"{s['train_loss_last_quarter_mean_gap']:+.4f}",
                "gnorm max": f"{s['grad_norm_rel_max']:.1e}",
                "skips": (f"{len(s['skipped']['ours'])} / {len(s['skipped']['olmo_core'])}"
                          + (f", first apart {s['skip_disagreements'][0]}" if s["skip_disagreements"] else "")),
                **{f"{n} max/final": f"{s['heldout_max'][n]:.2g} / {s['heldout_final'][n]:+.2g}"
                   for n in s["heldout_max"]},
            })
    columns = [("run", "run"), ("stage", "stage"), ("max", "train rel gap: max (same updates)"), ("final", "final"),
               ("p50/p99", "p50 / p99 (same updates)"), ("last quarter", "train gap, last quarter (nats)"),
               ("gnorm max", "grad-norm rel max"), ("skips", "skipped: ours / OLMo-core")]
    columns += [(k, f"held-out {k.split()[0]} max (same updates) / final, nats") for k in rows[0]
                if k.endswith("max/final")]
    return table(rows, columns)


def smooth(x: np.ndarray, n: int) -> np.ndarray:
    n = max(1, min(n, len(x)))
    return np.convolve(x, np.ones(n) / n, mode="valid")


FLOOR = 1e-10
"""Gaps of exactly 0 are drawn at this height on the logarithmic axes (a grey dotted line, named in the legend)."""
OURS = {"color": "C0", "lw": 0.8, "zorder": 3}
REFERENCE = {"color": "C1", "lw": 3.0, "alpha": 0.35, "zorder": 2}
"""OLMo-core's curves wide and light under ours, thin and dark on top: where they coincide both stay visible."""


def _gap_panel(ax, x, series: dict, gate: float | None, title: str, ylabel: str, colors: dict | None = None) -> None:
    """Absolute gaps on a logarithmic axis: per step as dots, per evaluation as a line through the points; exact
    zeros at FLOOR, with a line there that says so; the gate in red."""
    zero = False
    for n, v in series.items():
        v = np.abs(np.asarray(v, np.float64))
        zero |= bool((v == 0).any())
        dense = len(x) >= 100
        ax.semilogy(x, np.maximum(v, FLOOR), marker="." if dense else "o", ms=1.5 if dense else 3,
                    ls="" if dense else "-", lw=0.8, label=n or None, color=(colors or {}).get(n))
    if zero:
        ax.axhline(FLOOR, color="grey", ls=":", lw=0.8, label=f"gap exactly 0 (drawn at {FLOOR:g})")
    if gate is not None:
        ax.axhline(gate, color="red", lw=0.8, label=f"gate {gate:g}")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)


def plot(sides: dict[str, dict[int, Curves]], clean: dict[int, dict], fault: dict | None, out: Path) -> Path:
    """Rows: each stage's curves (ours thin and dark on top of OLMo-core's wide light line; dotted verticals where
    each side resumed after its kill) and each stage's gaps (absolute, logarithmic, the gates in red, exact zeros on
    a named floor); then the fault's gaps, each stage on its own axes; last, the distribution of the clean per-step
    gaps and olmo3eqx-compare's verdicts. Columns: training loss, held-out losses, gradient norm, learning rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = sorted(clean)
    rows = 2 * len(stages) + 2 * (fault is not None)
    fig, axes = plt.subplots(rows, 4, figsize=(20, 3.6 * rows), squeeze=False)
    sets = {n: f"C{2 + k}" for k, n in enumerate(next(iter(clean.values()))["heldout"])}
    for i, stage in enumerate(stages):
        ours, ref, g = sides["ours"][stage], sides["olmo-core"][stage], clean[stage]
        top, bottom = axes[2 * i], axes[2 * i + 1]
        for c, name, look in ((ref, "OLMo-core (wide, light)", REFERENCE), (ours, "ours (thin, on top)", OURS)):
            top[0].plot(c.steps, c.train["train/loss"], label=name, **look)
            for n, v in c.heldout.items():
                top[1].plot(c.eval_steps, v, marker="o", ms=4 if look is REFERENCE else 2,
                            label=f"{n}, {name.split(' (')[0]}", **{**look, "color": sets[n]})
            top[2].plot(c.steps, c.train["train/grad_norm"], label=name, **look)
            top[3].plot(c.steps, c.train["train/lr"], label=name, **look)
            if c.replayed:
                for ax in top:
                    ax.axvline(c.replayed["resumed_from_step"], ls=":", lw=0.8, color=look["color"],
                               label=f"{name.split(' (')[0]} resumed after its kill" if ax is top[0] else None)
        for ax, title, ylabel in zip(top, ("training loss", "held-out loss", "gradient norm (before clipping)",
                                           "learning rate"),
                                     ("cross-entropy (nats)", "cross-entropy (nats)", "L2 norm", "learning rate")):
            ax.set_title(f"stage {stage}: {title}", fontsize=10)
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            ax.legend(fontsize=7)
        top[0].set_ylim(top=float(np.quantile(ours.train["train/loss"], 0.98)) + 0.2)
        _gap_panel(bottom[0], ours.steps, {"": g["train_loss_rel"]}, GATES["train_loss_rel"],
                   f"stage {stage}: training-loss gap", "|ours - OLMo-core| / OLMo-core")
        _gap_panel(bottom[1], g["eval_steps"], g["heldout"], GATES["heldout"], f"stage {stage}: held-out gap",
                   "|ours - OLMo-core| (nats)", sets)
        _gap_panel(bottom[2], ours.steps, {"": g["grad_norm_rel"]}, None, f"stage {stage}: gradient-norm gap",
                   "|ours - OLMo-core| / OLMo-core")
        _gap_panel(bottom[3], ours.steps, {"": g["lr_rel"]}, None, f"stage {stage}: learning-rate gap",
                   "|ours - OLMo-core| / peak")
        for ax in bottom:
            if g["summary"]["skip_disagreements"]:
                ax.axvline(g["summary"]["same_updates_through"], color="black", ls="--", lw=0.8,
                           label="one side skips, the other not")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    if fault is not None:
        row, last = axes[-2], axes[-1]
        window = max(1, len(clean[stages[0]]["train_loss_rel"]) // 20)
        for k, stage in enumerate(stages):
            steps, ref_loss = sides["ours"][stage].steps, sides["olmo-core"][stage].train["train/loss"]
            train_ax, held_ax = row[2 * k], row[2 * k + 1]
            for g, name, look in ((clean[stage], "clean", {"color": "grey", "lw": 2.5, "alpha": 0.5}),
                                  (fault["gaps"][stage], "with the fault", {"color": "C3", "lw": 1.0})):
                gap = g["train_loss_rel"] * ref_loss
                train_ax.plot(steps[window - 1:], smooth(gap, window), label=f"ours {name}", **look)
                for n, v in g["heldout"].items():
                    held_ax.plot(g["eval_steps"], v, marker="o", ms=2, ls="-" if name != "clean" else "--",
                                 color=sets[n] if name != "clean" else "grey", lw=look["lw"],
                                 label=f"{n}, ours {name}")
            train_ax.set_title(f"stage {stage}, fault: training-loss gap ({window}-step mean)", fontsize=10)
            held_ax.set_title(f"stage {stage}, fault: held-out gap", fontsize=10)
            for ax in (train_ax, held_ax):
                ax.axhline(0, color="black", lw=0.5)
                ax.set_xlabel("step")
                ax.set_ylabel("ours - OLMo-core (nats)")
                ax.legend(fontsize=7)
        bins = np.logspace(np.log10(FLOOR), 0, 41)
        for k, stage in enumerate(stages):
            a = np.maximum(np.abs(clean[stage]["train_loss_rel"]), FLOOR)
            through = clean[stage]["summary"]["same_updates_through"]
            last[0].hist(a[:through], bins=bins, histtype="step", color=f"C{k}", label=f"stage {stage}" + (
                f", steps 1-{through}" if through < len(a) else ""))
            if through < len(a):
                last[0].hist(a[through:], bins=bins, histtype="step", ls="--", color=f"C{k}",
                             label=f"stage {stage}, after: different updates")
        last[0].set_xscale("log")
        last[0].axvline(GATES["train_loss_rel"], color="red", lw=0.8, label=f"gate {GATES['train_loss_rel']:g}")
        last[0].set_title("clean: per-step training-loss gaps", fontsize=10)
        last[0].set_xlabel("|ours - OLMo-core| / OLMo-core (exactly 0 counted at 1e-10)")
        last[0].set_ylabel("steps")
        last[0].legend(fontsize=7)
        grid = last[1].get_gridspec()
        for ax in last[1:]:
            ax.remove()
        words = fig.add_subplot(grid[-1, 1:])  # the verdicts, across the row's other three columns
        words.axis("off")
        text = ["olmo3eqx-compare A B (A = ours with the fault, B = OLMo-core)"]
        for stage in stages:
            v = fault["verdicts"][str(stage)]
            text += ["", f"stage {stage}:", *(fill(e, 120) for e in v["earlier"]), fill(v["line"], 120)]
        words.text(0.02, 0.5, "\n".join(text), fontsize=9, va="center", family="monospace",
                     color="red" if any(v["flagged"] or v["earlier_flagged"]
                                        for v in fault["verdicts"].values()) else "black")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=72)
    plt.close(fig)
    return out


def replot(out: Path) -> Path:
    """Draw `out`/reference_run.png again from `out`/reference_run.json alone (no training, no work directory):
    the curves and skips it stores give every gap the figure shows."""
    d = json.loads((out / "reference_run.json").read_text())

    def side(c: dict, skipped: list[int]) -> Curves:
        steps = np.arange(1, len(c["train/loss"]) + 1)
        train = {k: np.array(c[k], np.float64) for k in ("train/loss", "train/grad_norm", "train/lr")}
        train["train/skipped"] = np.isin(steps, skipped).astype(np.float64)
        return Curves(steps, train, np.array(c["eval_steps"]), {n: np.array(v, np.float64)
                                                                 for n, v in c["heldout"].items()}, c["replayed"])

    sides: dict[str, dict[int, Curves]] = {}
    for name in d["curves"]:
        sides[name] = {}
        for stage, c in d["curves"][name].items():
            stored = (d["fault"]["gaps"] if name == "ours-fault" else d["clean"])[stage]["summary"]["skipped"]
            sides[name][int(stage)] = side(c, stored["olmo_core" if name == "olmo-core" else "ours"])
    clean = {stage: gaps(sides["ours"][stage], sides["olmo-core"][stage]) for stage in sides["ours"]}
    for stage, g in clean.items():  # the gaps the JSON stores as such, as computed from the unrounded losses
        stored = d["clean"][str(stage)]
        g.update(train_loss_rel=np.array(stored["train_loss_rel"], np.float64),
                 eval_steps=np.array(stored["eval_steps"]),
                 heldout={n: np.array(v, np.float64) for n, v in stored["heldout"].items()})
    fault = None
    if d["fault"] is not None:
        fault = {**d["fault"], "gaps": {stage: gaps(sides["ours-fault"][stage], sides["olmo-core"][stage])
                                        for stage in sides["ours-fault"]}}
    return plot(sides, clean, fault, out / "reference_run.png")


def fill(text: str, width: int) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width))


def jsonable(x):
    """Plain JSON values; floats to 8 significant digits (float32's, which both sides log), NaN as null."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [jsonable(v) for v in (x.tolist() if isinstance(x, np.ndarray) else x)]
    if isinstance(x, Curves):
        return jsonable({"train/loss": x.train["train/loss"], "train/grad_norm": x.train["train/grad_norm"],
                         "train/lr": x.train["train/lr"], "eval_steps": x.eval_steps,
                         "heldout": x.heldout, "replayed": x.replayed})
    if isinstance(x, float):
        return float(f"{x:.8g}") if math.isfinite(x) else None
    return x


# --- the run ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=Plan.steps, help="stage-1 steps a side (one epoch of its mix)")
    p.add_argument("--stage2-steps", type=int, default=Plan.stage2_steps, help="stage-2 steps a side")
    p.add_argument("--eval-every", type=int, default=Plan.eval_every, help="held-out evaluation interval (steps)")
    p.add_argument("--heldout-docs", type=int, default=Plan.heldout_docs,
                   help="documents per held-out set (a multiple of the global batch, 8)")
    p.add_argument("--no-fault", action="store_true", help="skip the fault rerun")
    p.add_argument("--jobs", type=int, default=2, help="processes at once (each side of each stage is one)")
    p.add_argument("--timeout", type=float, default=4 * 3600.0, help="give up after this many seconds")
    p.add_argument("--out", default=str(OUT), help="directory for reference_run.json and reference_run.png")
    p.add_argument("--work", default=str(OUT / "work"), help="working directory, empty or new (runs, checkpoints, logs)")
    p.add_argument("--replot", action="store_true",
                   help="draw --out's reference_run.png again from its reference_run.json and stop (no training)")
    args = p.parse_args(argv)
    if args.replot:
        if not (Path(args.out) / "reference_run.json").is_file():
            p.error(f"--replot: {Path(args.out) / 'reference_run.json'} does not exist")
        print(f"wrote {replot(Path(args.out))}")
        return 0
    plan = Plan(steps=args.steps, stage2_steps=args.stage2_steps, eval_every=args.eval_every,
                heldout_docs=args.heldout_docs)
    for name in ("steps", "stage2_steps", "eval_every", "heldout_docs", "jobs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if plan.heldout_docs % plan.global_batch:
        p.error(f"--heldout-docs must be a multiple of the global batch {plan.global_batch} (OLMo-core's evaluator "
                f"drops a last partial batch)")
    if min(plan.steps, plan.stage2_steps) < 8:
        p.error("--steps and --stage2-steps must be at least 8 (a checkpoint, then the kill, then more steps)")
    out = Path(args.out)
    work = Path(args.work)
    if work.exists() and any(work.iterdir()):
        p.error(f"--work {work} is not empty; give a new directory (or delete it)")
    try:
        return run(plan, out, work, fault=not args.no_fault, max_jobs=args.jobs, timeout_s=args.timeout)
    except ValueError as e:  # the data cannot fill the plan
        print(f"error: {e}", file=sys.stderr)
        return exits.BAD_INPUT
    except RuntimeError as e:  # a side failed or ran past --timeout; its log's end is in the message
        print(f"error: {e}", file=sys.stderr)
        return 1


def run(plan: Plan, out: Path, work: Path, *, fault: bool, max_jobs: int, timeout_s: float) -> int:
    t0 = time.monotonic()
    python = sys.executable
    print(f"data -> {work / 'data'}", flush=True)
    data = prepare_data(plan, work)
    print("init: OLMo-core's weights, converted with convert.py hf-to-orbax", flush=True)
    init = work / "init"
    spec1 = olmo_core_spec(plan, 1, data, work / "olmo-core", init / "init.safetensors", None, full_optim(plan, 1))
    (work / "olmo-core").mkdir(parents=True, exist_ok=True)
    (work / "olmo-core" / "stage1.json").write_text(json.dumps(spec1, indent=1))
    init_job = Job("init", [python, str(BENCH / "reference_olmo_core.py"), "init", "--spec",
                            str(work / "olmo-core" / "stage1.json"), "--out", str(init)],
                   work / "init.jsonl", work / "logs" / "init.log")
    convert = Job("convert", [python, str(REPO / "convert.py"), "hf-to-orbax", "--hf-dir", str(init / "hf"), "--out",
                              str(init / "ckpt"), "--eos-token-id", str(EOS), "--pad-token-id", str(PAD)],
                  work / "convert.jsonl", work / "logs" / "convert.log", after=("init",))
    run_jobs([init_job, convert], 1, timeout_s)
    from olmo3eqx.checkpoint.layout import read_config, resolve_step_dir

    model = read_config(*resolve_step_dir(str(init / "ckpt")))["model"]

    import yaml

    runs, configs = work / "runs", work / "configs"
    configs.mkdir(parents=True)
    jobs = []
    names = ["ours"] + (["ours-fault"] if fault else [])
    for name in names:
        for stage in (1, 2):
            init_from = str(init / "ckpt") if stage == 1 else str(runs / f"{name}-stage1" / "checkpoints")
            cfg = configs / f"{name}-stage{stage}.yaml"
            cfg.write_text(yaml.safe_dump(our_config(plan, stage, data, f"{name}-stage{stage}", runs, init_from,
                                                     model), sort_keys=False))
            entry = [str(REPO / "train.py")] if name == "ours" else [str(BENCH / "reference_fault.py"), "--shards",
                                                                      str(plan.shards)]
            jobs.append(Job(f"{name}-stage{stage}", [python, *entry, "--config", str(cfg)],
                            runs / f"{name}-stage{stage}" / "metrics.jsonl", work / "logs" / f"{name}-stage{stage}.log",
                            kill_at=plan.kill_at(stage) if name == "ours" else None,
                            after=(f"{name}-stage1",) if stage == 2 else ()))
    side = work / "olmo-core"
    spec2 = olmo_core_spec(plan, 2, data, side, None, side / "stage1", full_optim(plan, 2))
    (side / "stage2.json").write_text(json.dumps(spec2, indent=1))
    for stage, spec in ((1, spec1), (2, spec2)):
        jobs.append(Job(f"olmo-core-stage{stage}", [python, str(BENCH / "reference_olmo_core.py"), "train", "--spec",
                                                     str(side / f"stage{stage}.json")],
                        Path(spec["metrics"]), work / "logs" / f"olmo-core-stage{stage}.log",
                        kill_at=plan.kill_at(stage),
                        after=("olmo-core-stage1",) if stage == 2 else ()))
    order = {"ours-stage1": 0, "olmo-core-stage1": 1, "ours-fault-stage1": 2, "ours-stage2": 3, "olmo-core-stage2": 4,
             "ours-fault-stage2": 5}
    jobs.sort(key=lambda j: order[j.name])
    print(f"training: {len(jobs)} runs, {max_jobs} at a time (logs in {work / 'logs'})", flush=True)
    run_jobs(jobs, max_jobs, timeout_s - (time.monotonic() - t0))
    record = {"plan": dataclasses.asdict(plan), "fault": fault, "total_wall_s": round(time.monotonic() - t0, 1),
              "jobs": {j.name: {"metrics": str(j.metrics), "wall_s": round(j.wall_s, 1), "cpu_s": round(j.cpu_s, 1),
                                "launches": j.launches, "killed_at_line": j.killed_at_line}
                       for j in [init_job, convert, *jobs]}}
    (work / JOBS).write_text(json.dumps(record, indent=1))
    return report(work, out)


JOBS = "jobs.json"
"""In the work directory once training is done: the plan and each job's metrics file, cost and kill, all that
`report` reads besides the metrics (so a report can be made again without training: report(work, out))."""


def report(work: Path, out: Path) -> int:
    """The gaps, verdicts, gates, JSON and PNG of the finished runs in `work`; returns the exit code."""
    record = json.loads((work / JOBS).read_text())
    plan, fault, jobs = Plan(**record["plan"]), record["fault"], record["jobs"]
    sets = list(HELDOUT_SETS)
    sides: dict[str, dict[int, Curves]] = {}
    for name in ["ours", "olmo-core"] + (["ours-fault"] if fault else []):
        sides[name] = {}
        for stage in (1, 2):
            job = jobs[f"{name}-stage{stage}"]
            scale = {n: olmo_core_heldout_scale(plan) for n in sets} if name == "olmo-core" else None
            recs = records_of(Path(job["metrics"]), scale)
            sides[name][stage] = curves(recs, plan.stage_steps(stage), sets, job["killed_at_line"])
    clean = {stage: gaps(sides["ours"][stage], sides["olmo-core"][stage]) for stage in (1, 2)}
    pairs = {"clean": "ours"} | ({"fault": "ours-fault"} if fault else {})
    verdicts = {}
    for label, name in pairs.items():
        verdicts[label] = {}
        for stage in (1, 2):
            a = as_run_dir(sides[name][stage], work / "compare" / f"{name}-stage{stage}")
            b = as_run_dir(sides["olmo-core"][stage], work / "compare" / f"olmo-core-stage{stage}")
            verdicts[label][str(stage)] = verdict(a, b, work / "compare" / f"{label}-stage{stage}.png",
                                                  compare_windows(plan, stage))
    fault_report = None
    if fault:
        fault_report = {"shards": plan.shards,
                        "gaps": {stage: gaps(sides["ours-fault"][stage], sides["olmo-core"][stage])
                                 for stage in (1, 2)},
                        "verdicts": verdicts["fault"]}
    gates = check_gates(clean, {stage: sides["olmo-core"][stage].replayed for stage in (1, 2)}, fault_report)
    png = plot(sides, clean, fault_report, out / "reference_run.png")
    costs = {n: {k: j[k] for k in ("wall_s", "cpu_s", "launches")} for n, j in jobs.items()}
    result = {
        "plan": record["plan"], "gates": gates, "costs": costs, "total_wall_s": record["total_wall_s"],
        "optim": {str(s): full_optim(plan, s) for s in (1, 2)},
        "resumes": {n: {str(s): c.replayed for s, c in by_stage.items() if c.replayed}
                    for n, by_stage in sides.items()},
        # The per-step curves of every run, and of the gaps those the PNG shows as such (the rest follow from them).
        "clean": {stage: {k: g[k] for k in ("summary", "train_loss_rel", "eval_steps", "heldout")}
                  for stage, g in clean.items()},
        "verdicts": verdicts,
        "fault": None if fault_report is None else {
            **fault_report, "gaps": {stage: {k: g[k] for k in ("summary", "eval_steps", "heldout")}
                                     for stage, g in fault_report["gaps"].items()}},
        "curves": sides,
    }
    path = out / "reference_run.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    # Compact: the per-step curves of six runs are most of it (the docs keep one).
    path.write_text(json.dumps(jsonable({"machine": machine(), **result}), separators=(",", ":")) + "\n")
    print()
    print(gap_table(clean, fault_report))
    print()
    for n, by_stage in result["resumes"].items():
        for s, r in by_stage.items():
            print(f"resume {n} stage {s}: killed after step {r['killed_after_step']}, resumed from step "
                  f"{r['resumed_from_step']}, {r['steps_replayed']} steps logged again, largest loss difference "
                  f"{r['max_abs_loss_diff']:.3g}")
    for label, by_stage in verdicts.items():
        for s, v in by_stage.items():
            for e in v["earlier"]:
                print(f"olmo3eqx-compare, {label} stage {s}: {e}")
            print(f"olmo3eqx-compare, {label} stage {s}: {v['line']}")
    for name, g in gates.items():
        print(f"gate {name}: {'holds' if g['holds'] else 'FAILS'} (limit {g['limit']}, seen {g['seen']})")
    print(f"cost: {result['total_wall_s']:.0f} s in all; " + ", ".join(
        f"{n} {c['wall_s']:.0f} s ({c['cpu_s']:.0f} CPU s)" for n, c in costs.items()))
    print(f"wrote {path} and {png}")
    return 0 if all(g["holds"] for g in gates.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
