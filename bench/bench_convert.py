"""Conversion memory: peak RSS and wall time of `convert.py hf-to-orbax` and `orbax-to-hf` on a synthetic multi-shard
HF checkpoint of a few GB, next to the size of its largest safetensors shard and of the model's largest leaf.

    python bench/bench_convert.py [--layers 4 --vocab 32768 --shard-gb 1.0] [--dir /tmp] [--json bench/results/convert.json]

The checkpoint is a random Olmo3ForCausalLM of 7B width (hidden 4096, MLP 11008, 32 x 128 heads) but few layers,
written by safetensors' own `save_file` in shards of --shard-gb (transformers' layout: config.json, shards, index).
Each command runs in a fresh process (`--child`) that reports its own peak RSS (getrusage ru_maxrss) on one CPU
device, so every array the conversion holds is host memory. The round trip is then checked tensor by tensor against
the source (bit-exact), and every file is deleted unless --keep.

The conversion holds one model leaf at a time (a stacked block leaf holds every layer's tensor of one kind), so the
peak follows the largest leaf, not the model: the note in the output extrapolates it to OLMo 3 7B.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
OLMO3_7B_LARGEST_LEAF = 32 * 4096 * 11008
"""Elements of the 7B's largest leaf: one MLP projection stacked over 32 layers."""


WIDTHS = {"7b": (4096, 11008, 32), "tiny": (64, 160, 4)}
"""(hidden, MLP, heads of 128 dims... for tiny 16): the 7B's width, and a toy one for the test and the baseline."""


def model_config(layers: int, vocab: int, width: str = "7b") -> dict:
    """config.json of the synthetic checkpoint: `width`, `layers` deep (OLMo's 3 sliding + 1 full pattern)."""
    hidden, mlp, heads = WIDTHS[width]
    return {"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "vocab_size": vocab, "hidden_size": hidden,
            "intermediate_size": mlp, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": heads, "head_dim": hidden // heads, "sliding_window": 4096, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 65536, "eos_token_id": 0, "pad_token_id": 1, "tie_word_embeddings": False,
            "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
                             "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.2079441541679836}}


def synthesize(out: Path, config: dict, shard_bytes: float, seed: int = 0) -> dict:
    """Random float32 weights in transformers' names and order, one shard in memory at a time; returns the sizes."""
    import numpy as np
    from safetensors.numpy import save_file


    from olmo3eqx.hf import config_json, weights

    cfg = config_json.config_from_hf(config)
    specs = weights.tensor_specs(cfg)
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True)
    shards = weights.plan_shards(specs, 4, int(shard_bytes))
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    weight_map, sizes = {}, []
    for name, shard in zip(names, shards):
        tensors = {s.hf_name: rng.random(s.hf_shape, dtype=np.float32) - 0.5 for s in shard}
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        sizes.append((out / name).stat().st_size)
        weight_map.update({s.hf_name: name for s in shard})
        del tensors
    total = sum(math.prod(s.hf_shape) for s in specs) * 4
    (out / weights.INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (out / config_json.CONFIG_FILE).write_text(json.dumps(config))
    leaves = {path: sum(math.prod(s.hf_shape) for s in group) * 4 for path, group in weights.leaf_groups(specs).items()}
    return {"model_bytes": total, "shards": len(names), "largest_shard_bytes": max(sizes),
            "largest_leaf_bytes": max(leaves.values()), "largest_leaf": ".".join(max(leaves, key=leaves.get))}


def check_same_tensors(src: Path, dst: Path) -> int:
    """Compare every tensor of two HF directories, one tensor in memory at a time; returns the count."""
    import numpy as np
    from safetensors import safe_open

    def index(d: Path) -> dict[str, Path]:
        return {k: d / v for k, v in json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].items()}

    a, b = index(src), index(dst)
    if set(a) != set(b):
        raise AssertionError(f"tensor names differ: {sorted(set(a) ^ set(b))[:5]}")
    for name in a:
        with safe_open(str(a[name]), framework="numpy") as fa, safe_open(str(b[name]), framework="numpy") as fb:
            if not np.array_equal(fa.get_tensor(name), fb.get_tensor(name)):
                raise AssertionError(f"tensor {name} differs after the round trip")
    return len(a)


def run_child(args: list[str]) -> dict:
    """One convert.py command in a fresh process; its wall time and peak RSS."""
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user's laptop or login node runs it
    proc = subprocess.run([sys.executable, __file__, "--child", *args], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"convert.py {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child(args: list[str]) -> int:
    from olmo3eqx.tools.convert import main

    t0 = time.perf_counter()
    with open(os.devnull, "w") as quiet:
        stdout, sys.stdout = sys.stdout, quiet
        try:
            rc = main(args)
        finally:
            sys.stdout = stdout
    wall = time.perf_counter() - t0
    print(json.dumps({"rc": rc, "wall_s": wall, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                      * 1024}))
    return rc


def convert_both_ways(work: Path, config: dict, shard_gb: float) -> tuple[dict, dict, int, float]:
    """(sizes, {command: wall and peak RSS}, tensors checked, synthesis seconds) for one synthetic checkpoint."""
    src, ckpt, back = work / "hf", work / "orbax", work / "hf-back"
    t0 = time.perf_counter()
    sizes = synthesize(src, config, shard_gb * GB)
    synth_s = time.perf_counter() - t0
    rows = {"hf-to-orbax": run_child(["hf-to-orbax", "--hf-dir", str(src), "--out", str(ckpt), "--skip-parity"]),
            "orbax-to-hf": run_child(["orbax-to-hf", "--ckpt", str(ckpt), "--out", str(back),
                                      "--max-shard-gb", str(shard_gb)])}
    return sizes, rows, check_same_tensors(src, back), synth_s


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return child(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--width", choices=sorted(WIDTHS), default="7b", help="tiny: a toy model (the test's)")
    p.add_argument("--shard-gb", type=float, default=1.0)
    p.add_argument("--dir", default=None, help="where to write the checkpoints (default: the system temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the files")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "convert.json"))
    a = p.parse_args(argv)

    sys.path.insert(0, str(ROOT / "bench"))
    from common import write_json

    work = Path(tempfile.mkdtemp(prefix="olmo3eqx-convert-bench-", dir=a.dir))
    try:
        # The same commands on a toy checkpoint: the processes' fixed cost (Python, JAX, orbax, safetensors).
        _, base, _, _ = convert_both_ways(work / "baseline", model_config(4, 1000, "tiny"), 0.0001)
        sizes, rows, checked, synth_s = convert_both_ways(work / "run", model_config(a.layers, a.vocab, a.width),
                                                          a.shard_gb)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)

    print(f"synthetic Olmo3: {a.layers} layers of 7B width, vocab {a.vocab}: {sizes['model_bytes'] / GB:.2f} GB "
          f"float32 in {sizes['shards']} shards (largest {sizes['largest_shard_bytes'] / GB:.2f} GB), largest leaf "
          f"{sizes['largest_leaf']} {sizes['largest_leaf_bytes'] / GB:.2f} GB; written in {synth_s:.0f} s")
    print(f"{'command':<12}  {'wall s':>7}  {'peak RSS GB':>11}  {'baseline GB':>11}  {'/ largest shard':>15}  "
          f"{'(peak - baseline) / largest leaf':>32}  {'/ model':>7}")
    leaf_7b = OLMO3_7B_LARGEST_LEAF * 4
    for name, r in rows.items():
        rss, floor = r["peak_rss_bytes"], base[name]["peak_rss_bytes"]
        r["baseline_rss_bytes"] = floor
        r["per_leaf"] = (rss - floor) / sizes["largest_leaf_bytes"]
        r["olmo3_7b_estimate_bytes"] = floor + r["per_leaf"] * leaf_7b
        print(f"{name:<12}  {r['wall_s']:>7.1f}  {rss / GB:>11.2f}  {floor / GB:>11.2f}  "
              f"{rss / sizes['largest_shard_bytes']:>15.2f}  {r['per_leaf']:>32.2f}  {rss / sizes['model_bytes']:>7.2f}")
    print(f"round trip: {checked} tensors bit-identical to the source")
    for name, r in rows.items():
        print(f"  {name}: OLMo 3 7B in float32 (29.2 GB; largest leaf, an MLP projection over 32 layers, "
              f"{leaf_7b / GB:.2f} GB) would peak near {r['olmo3_7b_estimate_bytes'] / GB:.1f} GB "
              f"(baseline + {r['per_leaf']:.2f} x that leaf)")
    write_json(Path(a.json), {"args": vars(a), "sizes": sizes, "synthesize_s": synth_s, "results": rows,
                              "baseline": base, "tensors_checked": checked})
    return 0


if __name__ == "__main__":
    sys.exit(main())
