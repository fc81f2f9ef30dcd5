"""The stored TPU results the docs' tables are made from (docs/results/, which bench/bench_tpu_validate.py,
bench_tpu_plan.py and bench_tpu_memory.py write): every cell says how it was made (command, date, jax and libtpu
versions); the docs' validation and memory tables are the ones the JSON gives, the validation with the spread the dry
run prints; and a preset leaves `remat: full` on a chip only where a stored plan predicts a gain larger than the
model's measured error. CPU only: nothing is compiled, the JSON is read."""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import pytest

from olmo3eqx import costmodel
from olmo3eqx.config import chip_name, load_yaml, remat_by_chip_entries

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
sys.path.insert(0, str(REPO / "bench"))
import bench_collectives  # noqa: E402
import bench_tpu_memory  # noqa: E402
import bench_tpu_plan  # noqa: E402
import bench_tpu_validate  # noqa: E402

DOCS = REPO / "docs" / "tpu-gpu.md"


def stored(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())["results"]


def stored_or_none(name: str) -> dict:
    """A results file that may not be stored in a checkout that trims docs/results/ (the presets' rule then has no
    plan behind any chip)."""
    return stored(name) if (RESULTS / name).is_file() else {}


@pytest.mark.parametrize("name", sorted(p.name for p in RESULTS.glob("*.json")))
def test_every_stored_cell_says_how_it_was_made(name):
    cells = stored(name)
    assert cells
    for key, cell in cells.items():
        made = cell["provenance"]
        assert made["command"].startswith(("python bench/bench_tpu_", "python bench/bench_collectives.py")), key
        assert datetime.datetime.fromisoformat(made["date"]).tzinfo is not None, key
        assert made["versions"]["jax"] and made["versions"]["libtpu"], key


def test_the_docs_validation_table_is_the_stored_one():
    assert bench_tpu_validate.markdown(stored("tpu_validation.json")) in DOCS.read_text()


def test_the_docs_memory_table_is_the_stored_one():
    """The 7B stage-1 memory table (16 compiles: two slices, two head shapes, four remat policies) as
    bench_tpu_memory.py stored it, every cell."""
    cells = stored("tpu_memory.json")
    assert len(cells) == 16
    assert bench_tpu_memory.markdown(cells) in DOCS.read_text()


def test_the_stage3_memory_table_is_the_stored_one():
    """docs/stages.md's stage-3 table (the 65,536-token step on v5p and Ironwood, four remat policies each) as
    `bench_tpu_memory.py --config configs/olmo3-7b-stage3.yaml` stored it."""
    cells = stored("tpu_memory_olmo3-7b-stage3.json")
    assert {key.split("/")[0] for key in cells} == {"v5p:4x4x4", "tpu7x:4x4x2"}
    assert bench_tpu_memory.markdown(cells) in (REPO / "docs" / "stages.md").read_text()


def test_the_stated_error_comes_from_five_or_more_published_measurements():
    assert len(bench_tpu_validate.ratios(stored("tpu_validation.json"))) >= 5


def test_every_prediction_states_the_stored_spread():
    """What the dry run prints beside a prediction (costmodel.PUBLISHED), and the README, is the stored validation's
    spread."""
    saved = stored("tpu_validation.json")
    low, high = bench_tpu_validate.spread(saved)
    assert costmodel.PUBLISHED == (len(bench_tpu_validate.ratios(saved)), round(low, 2), round(high, 2))
    assert f"predicted {low:.2f} to {high:.2f} times the measured throughput" in (REPO / "README.md").read_text()


def test_the_docs_plan_tables_are_the_stored_ones():
    """Every (preset, slice) of docs/results/tpu_plan.json is in docs/tpu-gpu.md as `bench_tpu_plan.py --markdown`
    prints it, every cell, the preset's choice under the error rule in bold; the docs have no plan table besides."""
    plans = stored("tpu_plan.json")
    error = bench_tpu_validate.model_error(stored("tpu_validation.json"))
    text = DOCS.read_text()
    pairs = sorted({tuple(key.split("/")[:2]) for key in plans})
    for preset, topology in pairs:
        table = bench_tpu_plan.docs_table(plans, preset, topology, heads_of(preset), error)
        assert table in text, f"docs/tpu-gpu.md lacks the stored plan of {preset} on {topology}"
    header = bench_tpu_plan.markdown([], None).splitlines()[0]
    assert text.count(header) == len(pairs)


def heads_of(preset: str) -> str:
    model = load_yaml(REPO / "configs" / preset).model
    return f"{model.num_attention_heads}x{model.head_dim}"


@pytest.mark.parametrize("preset", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_presets_leave_full_remat_only_for_a_gain_beyond_the_models_error(preset):
    """Every remat_by_chip entry is the planner's choice under the error rule (bench_tpu_plan.preset_remat) from
    stored cells of that preset; a chip whose stored plan keeps `full`, or that has no stored plan, has no entry."""
    error = bench_tpu_validate.model_error(stored("tpu_validation.json"))
    entries = dict(remat_by_chip_entries(load_yaml(REPO / "configs" / preset).model.remat_by_chip))
    plans = stored_or_none("tpu_plan.json")
    kinds = {key.split("/")[1]: cell["device_kind"] for key, cell in plans.items() if key.startswith(f"{preset}/")}
    taken = {}
    for topology, kind in kinds.items():
        rows = bench_tpu_plan.candidates(bench_tpu_plan.plan_rows(plans, preset, topology), heads_of(preset))
        take = bench_tpu_plan.preset_remat(rows, error)[0] if rows else None
        taken[chip_name(kind)] = take["remat"] if take else None
    for chip, policy in entries.items():
        assert chip in taken, f"{preset}: remat_by_chip {chip}={policy} has no stored plan behind it"
    for chip, take in taken.items():
        assert entries.get(chip, "full") == take, (preset, chip, take, f"error {error:.3f}")


EPHEMERAL_LOSS_S = 30 * 60
"""What a failure may lose at most on the planned slice, the presets' checkpoint.ephemeral_every being set by it
(docs/checkpoints.md): K x predicted step x PREDICTION_FACTOR, K the largest divisor of checkpoint.every that fits."""
PREDICTION_FACTOR = 1.35
"""How much slower than predicted a measured step was at most, among the validation rows at 8192 tokens (rounded
up; docs/tpu-gpu.md#against-published-measurements)."""


def test_the_prediction_factor_covers_every_validated_row_at_8192_tokens():
    found = bench_tpu_validate.ratios(stored("tpu_validation.json"))
    at_8192 = [found[row.key] for row in bench_tpu_validate.PUBLISHED
               if row.key in found and load_yaml(REPO / row.args[1]).data.seq_len == 8192]
    assert len(at_8192) >= 5 and max(at_8192) <= PREDICTION_FACTOR < max(at_8192) + 0.01, at_8192


@pytest.mark.parametrize("preset", sorted({key.split("/")[0] for key in stored_or_none("tpu_plan.json")}))
def test_presets_ephemeral_checkpoints_lose_at_most_30_minutes_of_the_slowest_planned_slice(preset):
    plans = stored("tpu_plan.json")
    error = bench_tpu_validate.model_error(stored("tpu_validation.json"))
    steps = {}
    for topology in sorted({key.split("/")[1] for key in plans if key.startswith(f"{preset}/")}):
        rows = bench_tpu_plan.candidates(bench_tpu_plan.plan_rows(plans, preset, topology), heads_of(preset))
        steps[topology] = float(bench_tpu_plan.preset_remat(rows, error)[0]["step"])
    ckpt = load_yaml(REPO / "configs" / preset).checkpoint
    fits = [k for k in range(1, ckpt.every) if ckpt.every % k == 0 and
            k * max(steps.values()) * PREDICTION_FACTOR <= EPHEMERAL_LOSS_S]
    assert ckpt.ephemeral_every == max(fits), (preset, steps)


def test_the_docs_collective_tables_are_the_stored_ones():
    """docs/tpu-gpu.md's before/after table and GPU cluster plan are bench_collectives.py --markdown of the stored
    cells."""
    stored_all = json.loads((RESULTS / "collectives.json").read_text())
    text = DOCS.read_text()
    assert bench_collectives.markdown(stored_all) in text
    assert bench_collectives.plan_markdown(stored_all, load_yaml(REPO / "configs" / "olmo3-7b-stage1.yaml")) in text


@pytest.mark.parametrize("key", sorted(k for k, c in stored_or_none("collectives.json").items()
                                       if c["variant"] == "after" and c["mesh"]["tensor"] == 1))
def test_after_weights_cross_in_bfloat16_gradients_in_float32_and_nothing_sharded_crosses_a_node(key):
    """Every stored 7B step of today's program ("after"): its all-gathers are the weights' and move bfloat16 (the token ids'
    int32 a rounding error), the gradients' reductions over the batch axes are float32, and across nodes or slices
    only the data axis runs: no fsdp or tensor group spans two, save the sums over every device of what is replicated
    (the norm weights' gradients, the loss's scalars: under 1% of the bytes; 0.1% on two GPU nodes). Meshes with a
    tensor axis are left out: there the embedding's or LM head's gradient is still reduced over data and fsdp at
    once (precision.hierarchical and loss.per_device apply without a tensor split only; docs/tpu-gpu.md says so)."""
    rows = stored("collectives.json")[key]["collectives"]["rows"]

    def share(kinds, dtype):
        moved = [r for r in rows if r["kind"] in kinds and set(r["axes"]) & {"data", "fsdp"}]
        total = sum(r["bytes_per_device"] for r in moved)
        return sum(r["bytes_per_device"] for r in moved if r["dtype"] == dtype) / total

    assert share(("all-gather",), "bf16") > 0.99, key
    assert share(("reduce-scatter", "all-reduce"), "f32") > 0.99, key
    across = sum(r["bytes_per_device"] for r in rows if r["link"] == "across")
    spanning = sum(r["bytes_per_device"] for r in rows if r["link"] == "across" and set(r["axes"]) - {"data"})
    assert spanning <= 1e-2 * across, key  # replicated leaves (norm weights) and scalars summed over every device
