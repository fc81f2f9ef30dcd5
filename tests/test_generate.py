"""KV-cached generation (olmo3eqx.decode, olmo3eqx.generate) against independent references: `transformers`'
generate(do_sample=False) token for token on converted checkpoints, the full forward pass at every position, the
softmax (a chi-square test) for sampling; bad input one sentence each."""

from __future__ import annotations

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo3eqx import decode as dec
from olmo3eqx import hf
from olmo3eqx.config import ModelConfig
from olmo3eqx.errors import GenerationError
from olmo3eqx.generate import generate
from olmo3eqx.tools.generate import main
from olmo3eqx.model import init_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

S, F = "sliding_attention", "full_attention"
YARN = {F: {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0, "original_max_position_embeddings": 32,
            "beta_fast": 32.0, "beta_slow": 1.0}, S: {"rope_type": "default", "rope_theta": 500000.0}}
# OLMo's pattern (3 sliding + 1 full) with a window far shorter than the prompts and the generation, so every ring
# wraps several times; grouped-query attention; YaRN on the full layers, past its original length. yarn-scan (MQA,
# YaRN, 8 layers scanned) runs in the default suite, window-gqa (GQA 4/2, 4 layers) with -m slow.
HF_CONFIGS = {
    "window-gqa": dict(num_hidden_layers=4, sliding_window=6, num_attention_heads=4, num_key_value_heads=2),
    "yarn-scan": dict(num_hidden_layers=8, sliding_window=8, num_attention_heads=4, num_key_value_heads=1,
                      rope_parameters=YARN, max_position_embeddings=256),
}
PROMPT_LENGTHS = (3, 11, 29)  # shorter than, about, and far longer than the windows
NEW = 40


@pytest.fixture(scope="module", params=[pytest.param("window-gqa", marks=pytest.mark.slow), "yarn-scan"])
def hf_model(request, tmp_path_factory):
    from olmo3eqx.tools.convert import save_tiny_hf_model

    path = tmp_path_factory.mktemp(request.param)
    save_tiny_hf_model(path, seed=3, init_std=0.3, **HF_CONFIGS[request.param])
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model, cfg = hf.load_hf(path)
    return ref.eval(), model, cfg


def hf_greedy(ref, prompt, new: int, eos: int | None) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                           min_new_tokens=0, eos_token_id=eos, pad_token_id=eos if eos is not None else 1,
                           use_cache=True, temperature=None, top_p=None, top_k=None)
    gen = out[0, len(prompt):].tolist()
    if eos is not None and eos in gen:
        gen = gen[:gen.index(eos)]
    return gen


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(2, vocab, n).tolist() for n in PROMPT_LENGTHS]


def test_greedy_equals_transformers_generate(hf_model):
    """Each prompt alone, and all of them in one left-padded batch, give transformers' tokens; past the window the
    sliding layers read their ring buffers."""
    ref, model, cfg = hf_model
    ps = prompts(cfg.vocab_size)
    want = [hf_greedy(ref, p, NEW, None) for p in ps]
    assert len({tuple(w) for w in want}) == len(ps)
    for p, w in zip(ps, want):
        [c] = generate(model, [p], max_new_tokens=NEW, eos_id=-1)
        assert c.tokens == w and c.finish == "length"
    batch = generate(model, ps, max_new_tokens=NEW, eos_id=-1, chunk=7)
    assert [c.tokens for c in batch] == want


def test_generation_stops_at_eos_like_transformers(hf_model):
    ref, model, cfg = hf_model
    p = prompts(cfg.vocab_size)[1]
    free = hf_greedy(ref, p, NEW, None)
    eos = free[9]  # a token greedy decoding emits: both must stop before its first occurrence
    want = hf_greedy(ref, p, NEW, eos)
    [c] = generate(model, [p], max_new_tokens=NEW, eos_id=eos)
    assert c.tokens == want == free[:free.index(eos)] and c.finish == "eos"
    # in a batch, the other rows keep going after one row ends
    out = generate(model, [p, prompts(cfg.vocab_size)[0]], max_new_tokens=NEW, eos_id=eos)
    assert out[0].tokens == want
    assert out[1].tokens == [t for t in hf_greedy(ref, prompts(cfg.vocab_size)[0], NEW, eos)]


def small_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, sliding_window=5, param_dtype="float32", compute_dtype="float32",
                eos_token_id=95, pad_token_id=94, max_position_embeddings=256)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("kw", [pytest.param({}, marks=pytest.mark.slow),  # ~20 s; the window cases cover it
                                {"sliding_window": 64}, {"num_hidden_layers": 5, "layer_types": (F, S, S, F, S)},
                                {"compute_dtype": "bfloat16"}])
def test_cached_logits_equal_the_full_forward_at_every_position(kw):
    """Prefill some tokens (left-padded differently per row), then feed the rest one by one: every position's logits
    equal model(tokens) over the unpadded row."""
    cfg = small_cfg(**kw)
    model = init_model(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    seq = rng.integers(0, cfg.vocab_size, size=(2, 30)).astype(np.int32)
    full = np.asarray(model(jnp.asarray(seq)))
    lengths, width = (7, 4), 8  # row 0: 1 pad column, row 1: 4
    tokens = np.zeros((2, width), np.int32)
    for r, n in enumerate(lengths):
        tokens[r, width - n:] = seq[r, :n]
    pad = jnp.asarray([width - n for n in lengths], jnp.int32)
    logits, cache = dec.prefill(model, jnp.asarray(tokens), pad, width + 30)
    tables = dec.decode_tables(cfg, width + 30)
    tol = 1e-4 if cfg.compute_dtype == "float32" else 0.15
    got = {r: [np.asarray(logits)[r]] for r in range(2)}
    fed = list(lengths)
    for _ in range(20):
        step = jnp.asarray([seq[r, fed[r]] for r in range(2)], jnp.int32)
        logits, cache = dec.decode_step(model, cache, step, tables)
        for r in range(2):
            got[r].append(np.asarray(logits)[r])
            fed[r] += 1
    for r, n in enumerate(lengths):
        want = full[r, n - 1:n - 1 + len(got[r])]
        np.testing.assert_allclose(np.stack(got[r]), want, atol=tol, rtol=tol)


def test_sharded_generation_equals_one_device():
    from olmo3eqx.config import MeshConfig
    from olmo3eqx.sharding import make_mesh, model_shardings

    cfg = small_cfg()
    model = init_model(cfg, jax.random.key(1))
    ps = [np.random.default_rng(i).integers(0, 90, 3 + 2 * i).tolist() for i in range(8)]
    want = [c.tokens for c in generate(model, ps, max_new_tokens=12, eos_id=-1)]
    mesh = make_mesh(MeshConfig(), jax.devices()[:8])
    sharded = jax.device_put(model, model_shardings(model, mesh))
    assert [c.tokens for c in generate(sharded, ps, max_new_tokens=12, eos_id=-1, mesh=mesh)] == want


def test_sampling_follows_the_softmax_and_is_reproducible():
    from scipy import stats

    logits = jnp.asarray([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 20000
    keys = jax.random.split(jax.random.key(0), n)
    draw = jax.jit(jax.vmap(lambda k, s: dec.sample_logits(logits, k, s)[0], in_axes=(0, None)),
                   static_argnums=1)
    for temperature in (1.0, 0.7):
        sampler = dec.Sampler(temperature=temperature)
        x = np.asarray(draw(keys, sampler))
        counts = np.bincount(x, minlength=6)
        p = np.asarray(jax.nn.softmax(logits[0] / temperature))
        chi2 = ((counts - n * p) ** 2 / (n * p)).sum()
        assert chi2 < stats.chi2.ppf(0.999, df=5), (counts, n * p)
        np.testing.assert_array_equal(x, np.asarray(draw(keys, sampler)))  # the same keys, the same tokens
    # top-k keeps the k most likely; top-p the smallest prefix reaching p (here {0, 1}: 0.56 < 0.7 <= 0.56 + 0.21)
    top_k = np.asarray(draw(keys, dec.Sampler(temperature=1.0, top_k=3)))
    assert set(top_k) == {0, 1, 2}
    probs = np.asarray(jax.nn.softmax(logits[0]))
    assert probs[0] < 0.7 <= probs[0] + probs[1]
    top_p = np.asarray(draw(keys, dec.Sampler(temperature=1.0, top_p=0.7)))
    assert set(top_p) == {0, 1}
    counts = np.bincount(top_p, minlength=2)[:2]
    renorm = probs[:2] / probs[:2].sum()
    assert ((counts - n * renorm) ** 2 / (n * renorm)).sum() < stats.chi2.ppf(0.999, df=1)
    both = np.asarray(draw(keys, dec.Sampler(temperature=1.0, top_k=3, top_p=0.5)))
    assert set(both) == {0}  # top-k's three renormalised: 0 alone holds 0.63 >= 0.5


def test_seeded_generation_is_reproducible_and_seeds_differ():
    cfg = small_cfg()
    model = init_model(cfg, jax.random.key(2))
    s = dec.Sampler(temperature=1.5, top_p=0.95)
    a = generate(model, [[1, 2, 3]], max_new_tokens=30, sampler=s, seed=7, eos_id=-1)[0].tokens
    assert a == generate(model, [[1, 2, 3]], max_new_tokens=30, sampler=s, seed=7, eos_id=-1, chunk=1)[0].tokens
    assert a != generate(model, [[1, 2, 3]], max_new_tokens=30, sampler=s, seed=8, eos_id=-1)[0].tokens


def test_stop_strings_cut_the_text_and_stream_nothing_past_them():
    cfg = small_cfg(vocab_size=300, eos_token_id=256, pad_token_id=257)
    model = init_model(cfg, jax.random.key(4))
    decode = lambda ids: "".join(chr(65 + i % 26) for i in ids)  # noqa: E731 - any ids -> text function
    [free] = generate(model, [[1, 2]], max_new_tokens=30, eos_id=-1, decode=decode)
    stop = free.text[12:14]
    streamed = []
    [c] = generate(model, [[1, 2]], max_new_tokens=30, eos_id=-1, decode=decode, stop=[stop, "never"], chunk=1,
                   on_text=lambda row, t: streamed.append(t))
    assert c.finish == "stop" and c.text == free.text[:free.text.index(stop)]
    assert "".join(streamed) == c.text


def test_bad_input_is_one_sentence():
    cfg = small_cfg()
    model = init_model(cfg, jax.random.key(0))
    for prompts_, words in [([[]], "is empty"), ([[1, 96]], "outside the model's vocabulary"),
                            ([[1] * 250], "more than the model's 256 positions")]:
        with pytest.raises(GenerationError, match=words):
            generate(model, prompts_, max_new_tokens=10)


@pytest.fixture(scope="module")
def byte_ckpt(tmp_path_factory):
    """A converted checkpoint (no tokenizer in it) of a model over the byte vocabulary."""
    from olmo3eqx.tools.convert import main as convert, save_tiny_hf_model

    root = tmp_path_factory.mktemp("bytes")
    save_tiny_hf_model(root / "hf", seed=1, vocab_size=258, eos_token_id=256, pad_token_id=257)
    assert convert(["hf-to-orbax", "--hf-dir", str(root / "hf"), "--out", str(root / "ckpt"), "--skip-parity"]) == 0
    return root


def test_cli_streams_the_completion_generate_gives(byte_ckpt, capsys):
    from olmo3eqx.tasks import Tokenizer

    rc = main(["--ckpt", str(byte_ckpt / "ckpt"), "--tokenizer", "bytes", "--max-new-tokens", "20", "def fib(n):"])
    out = capsys.readouterr().out
    assert rc == 0
    model, _ = hf.load_hf(byte_ckpt / "hf")
    tokenizer = Tokenizer.load("bytes")
    [c] = generate(model, [tokenizer.encode(["def fib(n):"])[0].tolist()], max_new_tokens=20, decode=tokenizer.decode)
    assert out == "def fib(n):" + c.text + "\n"


def test_cli_file_writes_one_line_per_prompt(byte_ckpt, tmp_path, capsys):
    prompts_file = tmp_path / "p.jsonl"
    prompts_file.write_text('{"prompt": "import os"}\n"x = 1"\n\n{"prompt": "class A:"}\n')
    rc = main(["--ckpt", str(byte_ckpt / "hf"), "--tokenizer", "bytes", "--file", str(prompts_file),
               "--out", str(tmp_path / "o.jsonl"), "--max-new-tokens", "8", "--temperature", "0.9", "--seed", "3"])
    assert rc == 0
    lines = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [x["prompt"] for x in lines] == ["import os", "x = 1", "class A:"]
    assert all(x["finish"] in ("eos", "length", "stop") and x["tokens"] <= 8 for x in lines)


def test_cli_errors(byte_ckpt, tmp_path, capsys):
    ckpt = str(byte_ckpt / "ckpt")
    cases = [([ckpt, "hello"], "names no tokenizer"),  # a converted checkpoint keeps only the model
             ([ckpt, "--tokenizer", "bytes", ""], "is empty"),
             ([ckpt, "--tokenizer", "bytes", "--max-new-tokens", "5000", "x"], "positions"),
             ([ckpt, "--tokenizer", "bytes", "--top-p", "0", "x"], "top_p"),
             ([ckpt, "--tokenizer", "bytes"], "No prompt")]
    for args, words in cases:
        rc = main(["--ckpt", *args])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and words in err and len(err.splitlines()) == 1, err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    assert main(["--ckpt", ckpt, "--tokenizer", "bytes", "--file", str(bad)]) == 2
    assert "Line 1" in capsys.readouterr().err


def test_cache_of_the_7b_is_bounded_on_sliding_layers():
    cfg = ModelConfig()  # the 7B: 24 sliding layers (window 4096), 8 full
    itemsize = jnp.dtype(cfg.compute_dtype).itemsize
    per_column = 2 * cfg.num_key_value_heads * cfg.head_dim * itemsize  # k and v
    at_8k = dec.cache_bytes(cfg, 1, 8192)
    at_65k = dec.cache_bytes(cfg, 1, 65536)
    assert at_8k == per_column * (24 * 4096 + 8 * 8192)
    assert at_65k == per_column * (24 * 4096 + 8 * 65536)


def test_chat_renders_the_template_around_the_message(byte_ckpt, capsys):
    """--chat --system: the completion is generate's on the byte template's rendering, built here by hand; the
    reply is printed alone."""
    from olmo3eqx.tasks import Tokenizer

    rc = main(["--ckpt", str(byte_ckpt / "ckpt"), "--tokenizer", "bytes", "--chat", "--system", "Be brief.",
               "--max-new-tokens", "12", "What is 1+1?"])
    out = capsys.readouterr().out
    assert rc == 0
    model, _ = hf.load_hf(byte_ckpt / "hf")
    prompt = list(b"System: Be brief.\nUser: What is 1+1?\nAssistant: ")
    [c] = generate(model, [prompt], max_new_tokens=12, decode=Tokenizer.load("bytes").decode)
    assert out == c.text + "\n"
    assert main(["--ckpt", str(byte_ckpt / "ckpt"), "--tokenizer", "bytes", "--system", "x", "q"]) == 2
    assert "add --chat" in capsys.readouterr().err


def test_chat_stops_at_the_templates_end_of_turn(tmp_path, capsys):
    """With OLMo's template (found in tokenizer_config.json beside the HF directory's tokenizer.json) generation
    stops at <|im_end|>: a model whose final norm is zero emits id 0, <|im_end|> here, at every step."""
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, trainers

    from olmo3eqx.data import chat

    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["What is 1+1? The answer is 2."] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|im_end|>", "<|endoftext|>", "<|pad|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    vocab = tok.get_vocab_size()
    cfg = small_cfg(vocab_size=vocab, eos_token_id=1, pad_token_id=2)
    model = init_model(cfg, jax.random.key(0))
    model = eqx.tree_at(lambda m: m.norm.weight, model, jnp.zeros_like(model.norm.weight))
    hf.save_hf(model, cfg, tmp_path / "hf")
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    olmo = (chat.TEMPLATES / "olmo.jinja").read_text()
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"chat_template": olmo}))
    assert main(["--ckpt", str(tmp_path / "hf"), "--chat", "--system", "Be brief.", "--max-new-tokens", "5",
                 "What is 1+1?"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "\n" and "[1 tokens" in captured.err and "ended by stop" in captured.err
    assert main(["--ckpt", str(tmp_path / "hf"), "--max-new-tokens", "5", "What is 1+1?"]) == 0  # no template: on
    assert "ended by length" in capsys.readouterr().err
