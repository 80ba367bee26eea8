"""Fast tests of clover.data (corpus, tasks, tokenizer, packed stream)."""

from __future__ import annotations

import ast
import json
import textwrap

import pytest

from clover.data import corpus, tasks
from clover.data import tokenizer as ctok

# ---------------------------------------------------------------------------- tasks


def _expected(t: tasks.Task):
    """Recompute the answer of a task independently from its prompt text."""
    expr = t.prompt[len("assert ") : -len(" == ")]
    node = ast.parse(expr, mode="eval").body
    lit = ast.literal_eval
    k = t.kind
    if k in ("add", "sub", "mul"):
        a, b = lit(node.left), lit(node.right)
        return {"add": a + b, "sub": a - b, "mul": a * b}[k]
    if k in ("sorted", "sorted_desc", "max", "min", "len", "sum"):
        xs = lit(node.args[0])
        if k == "sorted_desc":
            assert node.keywords[0].arg == "reverse"
            return sorted(xs, reverse=True)
        return {"sorted": sorted, "max": max, "min": min, "len": len, "sum": sum}[k](xs)
    if k == "reversed":
        return list(reversed(lit(node.args[0].args[0])))
    if k == "set_len":
        return len(set(lit(node.args[0].args[0])))
    if k == "slice_rev":
        return lit(node.value)[::-1]
    if k in ("index", "dict_get"):
        return lit(node.value)[lit(node.slice)]
    if k == "double":
        return [x * 2 for x in lit(node.generators[0].iter)]
    raise AssertionError(k)


def test_tasks_deterministic_by_seed():
    a = tasks.generate_tasks(300, seed=5)
    assert a == tasks.generate_tasks(300, seed=5)
    assert a != tasks.generate_tasks(300, seed=6)
    assert {t.kind for t in a} == set(tasks.KINDS)


def test_tasks_correct_by_construction():
    for t in tasks.generate_tasks(3000, seed=1):
        line = tasks.task_line(t)
        assert "\n" not in line
        assert t.prompt.endswith("== ") and t.prompt.startswith("assert ")
        assert line.count("== ") == 1
        assert ast.literal_eval(t.answer) == _expected(t), line
        ast.parse(line)  # the whole line is valid Python


def test_task_value_ranges():
    for t in tasks.generate_tasks(2000, seed=2):
        node = ast.parse(t.prompt[7:-4], mode="eval").body
        lists = [n for n in ast.walk(node) if isinstance(n, ast.List)]
        for lst in lists:
            xs = ast.literal_eval(lst)
            assert 2 <= len(xs) <= 8 and all(0 <= x < 100 for x in xs)
        if t.kind in ("add", "sub"):
            assert all(0 <= ast.literal_eval(x) < 1000 for x in (node.left, node.right))


def test_check_answer():
    t = tasks.Task(prompt="assert sorted([31, 7, 19]) == ", answer="[7, 19, 31]", kind="sorted")
    assert tasks.check_answer(t, "[7, 19, 31]")
    assert tasks.check_answer(t, " [7,19,31]  \nassert garbage ((")
    assert tasks.check_answer(t, "[7, 19, 31]\n")
    assert not tasks.check_answer(t, "[7, 31, 19]")
    assert not tasks.check_answer(t, "[7, 19]")
    assert not tasks.check_answer(t, "")
    assert not tasks.check_answer(t, "\n[7, 19, 31]")
    assert not tasks.check_answer(t, "[7, 19, 31")
    assert not tasks.check_answer(t, "sorted([31, 7, 19])")  # not a literal: never evaluated
    assert not tasks.check_answer(t, "__import__('os').getcwd()")
    assert not tasks.check_answer(t, "(7, 19, 31)")
    n = tasks.Task(prompt="assert 3 - 5 == ", answer="-2", kind="sub")
    assert tasks.check_answer(n, "-2")
    assert not tasks.check_answer(n, "-2.0")
    one = tasks.Task(prompt="assert len([1]) == ", answer="1", kind="len")
    assert not tasks.check_answer(one, "True")
    for t in tasks.generate_tasks(500, seed=3):
        assert tasks.check_answer(t, t.answer + "\n")
        assert not tasks.check_answer(t, t.answer + "1")


def test_train_heldout_disjoint():
    held = tasks.heldout_tasks()
    assert len(held) == tasks.HELDOUT_N == len({t.prompt for t in held})
    assert held[:10] == tasks.heldout_tasks(10)
    train = tasks.train_tasks(20000)
    assert not {t.prompt for t in train} & tasks.heldout_prompts()
    # the raw training seed does collide (small value spaces), so exclusion matters
    raw = tasks.generate_tasks(20000, tasks.TRAIN_SEED)
    assert {t.prompt for t in raw} & tasks.heldout_prompts()


# --------------------------------------------------------------------------- corpus


def test_corpus_split_stable_and_disjoint():
    train = corpus.stdlib_files("train")
    held = corpus.stdlib_files("heldout")
    assert train == sorted(train) and held == sorted(held)
    assert train and held
    assert not set(train) & set(held)
    frac = len(held) / (len(train) + len(held))
    assert 0.003 < frac < 0.06
    for p in held:
        assert corpus.split_of(corpus.relpath(p)) == "heldout"
    rels = [corpus.relpath(p) for p in train + held]
    for bad in ("site-packages/", "test/", "idlelib/", "lib2to3/"):
        assert not any(r.startswith(bad) or f"/{bad}" in r for r in rels)
    # the split is a pure function of the relative path
    assert corpus.split_of("json/decoder.py") == corpus.split_of("json/decoder.py")
    with pytest.raises(ValueError):
        corpus.stdlib_files("valid")  # type: ignore[arg-type]


def test_read_text(tmp_path):
    (tmp_path / "a.py").write_bytes(b"x = 1\r\ny = 2\r\n")
    (tmp_path / "b.py").write_bytes(b"x = '\xff'\n")
    (tmp_path / "c.py").write_bytes(b"#" * (corpus.MAX_FILE_BYTES + 1))
    assert corpus.read_text(tmp_path / "a.py") == "x = 1\ny = 2\n"
    assert corpus.read_text(tmp_path / "b.py") is None
    assert corpus.read_text(tmp_path / "c.py") is None
    assert corpus.read_text(tmp_path / "missing.py") is None


def test_heldout_functions():
    fns = corpus.heldout_functions(20, seed=0)
    assert len(fns) == 20
    assert fns == corpus.heldout_functions(20, seed=0)
    for header, body in fns:
        assert header.lstrip().startswith(("def ", "async def "))
        assert header.endswith(":\n") or header.rstrip().endswith(":")
        assert body.endswith("\n") and body.strip()
        ast.parse(textwrap.dedent(header + body))


# ------------------------------------------------------------------------ tokenizer


@pytest.fixture(scope="module")
def tiny_tok_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    ctok.train_tokenizer(out, vocab_size=400, max_chars=150_000, n_task_lines=400, verbose=False)
    return out


SAMPLE = (
    "class A:\n    def f(self, x):\n\tif x == 1234567890:\n\n        return [1, 2]  \n"
    "  \t \n\n\n    s = 'héllo wörld 😀 \\n'\r\n# trailing   \n<|endoftext|> x"
)


def test_tokenizer_round_trip_and_digits(tiny_tok_dir):
    tok = ctok.load_tokenizer(tiny_tok_dir)
    assert tok.get_vocab_size() == 400
    for text in (SAMPLE, "", " ", "\n", "  x", "x  ", "0123456789", "def f():\n    pass\n"):
        enc = tok.encode(text)
        assert tok.decode(enc.ids, skip_special_tokens=False) == text
    for d in "0123456789":
        assert tok.token_to_id(d) is not None
    enc = tok.encode("x = 9876543210 + 42")
    digit_toks = [s for s in enc.tokens if any(c.isdigit() for c in s)]
    assert digit_toks == list("987654321042")
    ids = ctok.special_token_ids(tok)
    assert ids == {t: i for i, t in enumerate(ctok.SPECIAL_TOKENS)}
    assert tok.encode("<|mask|><|im_start|>").ids == [ids["<|mask|>"], ids["<|im_start|>"]]


def test_tokenizer_prompt_boundaries(tiny_tok_dir):
    tok = ctok.load_tokenizer(tiny_tok_dir)
    for t in tasks.generate_tasks(200, seed=9):
        full = tok.encode(tasks.task_line(t)).ids
        assert tok.encode(t.prompt).ids + tok.encode(t.answer).ids == full
    header, body = "    def f(self, x):\n", "        return x == 1\n"
    assert tok.encode(header).ids + tok.encode(body).ids == tok.encode(header + body).ids


def test_tokenizer_deterministic(tiny_tok_dir, tmp_path):
    ctok.train_tokenizer(tmp_path, vocab_size=400, max_chars=150_000, n_task_lines=400, verbose=False)
    assert (tmp_path / "tokenizer.json").read_text() == (tiny_tok_dir / "tokenizer.json").read_text()


def test_clover_train_tokenizer(tiny_tok_dir, tmp_path, capsys):
    """`clover train tokenizer OUT_DIR` writes the tokenizer `train_tokenizer` makes with the same
    arguments; a vocabulary too small for the bytes and special tokens is a one-line usage error."""
    from clover.cli.train import main as train_main

    args = ["--vocab-size", "400", "--max-chars", "150000", "--task-lines", "400"]
    assert train_main(["tokenizer", str(tmp_path / "tok"), *args]) == 0
    assert (tmp_path / "tok" / "tokenizer.json").read_text() == (tiny_tok_dir / "tokenizer.json").read_text()
    assert json.loads(capsys.readouterr().out)["special_token_ids"] == ctok.special_token_ids(ctok.load_tokenizer(tiny_tok_dir))
    with pytest.raises(SystemExit) as e:
        train_main(["tokenizer", str(tmp_path / "small"), "--vocab-size", "100"])
    assert e.value.code == 2 and "--vocab-size must hold" in capsys.readouterr().err
    assert not (tmp_path / "small").exists()


def test_autotokenizer_loads(tiny_tok_dir):
    transformers = pytest.importorskip("transformers")
    at = transformers.AutoTokenizer.from_pretrained(str(tiny_tok_dir))
    assert at.is_fast
    assert at.eos_token == "<|endoftext|>" and at.eos_token_id == 0
    assert at.pad_token == "<|pad|>" and at.pad_token_id == 1
    assert at.mask_token == "<|mask|>" and at.mask_token_id == 2
    ids = at(SAMPLE, add_special_tokens=True)["input_ids"]
    assert ids == ctok.load_tokenizer(tiny_tok_dir).encode(SAMPLE).ids
    assert at.decode(ids) == SAMPLE
    msgs = [{"role": "user", "content": "hi\n  there"}, {"role": "assistant", "content": "ok"}]
    text = at.apply_chat_template(msgs, tokenize=False)
    assert text == "<|im_start|>user\nhi\n  there<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n"
    gen = at.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert gen.endswith("<|im_end|>\n<|im_start|>assistant\n")
    out = at.apply_chat_template(msgs[:1], add_generation_prompt=True)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    assert ids[0] == at.convert_tokens_to_ids("<|im_start|>")
    cfg = json.loads((tiny_tok_dir / "tokenizer_config.json").read_text())
    assert "chat_template" in cfg


# --------------------------------------------------------------------------- stream


@pytest.fixture(scope="module")
def stream_args(tiny_tok_dir, tmp_path_factory):
    return dict(
        tokenizer=tiny_tok_dir,
        seq_len=64,
        batch_size=3,
        seed=7,
        cache_dir=tmp_path_factory.mktemp("cache"),
        max_files=12,
    )


def test_packed_stream_shapes_and_determinism(stream_args):
    torch = pytest.importorskip("torch")
    from clover.data.mix import PackedStream

    s1 = PackedStream(**stream_args)
    s2 = PackedStream(**stream_args)
    b1 = [next(s1) for _ in range(20)]
    b2 = [s2.next_batch() for _ in range(20)]
    for a, b in zip(b1, b2):
        assert a.shape == (3, 64) and a.dtype == torch.int64
        assert torch.equal(a, b)
    assert not torch.equal(b1[0][0], b1[0][1])  # rows are different streams
    allt = torch.cat(b1).flatten()
    assert (allt == 0).any()  # EOS separators present
    assert int(allt.max()) < 400 and int(allt.min()) >= 0
    other = PackedStream(**{**stream_args, "seed": 8})
    assert not torch.equal(next(other), b1[0])
    # cache is reused (npy files exist, no pickle)
    cache = list(stream_args["cache_dir"].rglob("*.npy"))
    assert {p.name for p in cache} == {"tokens.npy", "offsets.npy"}


def test_packed_stream_resume(stream_args):
    torch = pytest.importorskip("torch")
    from clover.data.mix import PackedStream

    s = PackedStream(**stream_args)
    for _ in range(7):
        next(s)
    state = json.loads(json.dumps(s.state_dict()))
    want = [next(s) for _ in range(10)]
    r = PackedStream(**stream_args)
    r.load_state_dict(state)
    got = [next(r) for _ in range(10)]
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    bad = PackedStream(**{**stream_args, "seq_len": 32})
    with pytest.raises(ValueError):
        bad.load_state_dict(state)


def test_packed_stream_content(stream_args):
    pytest.importorskip("torch")
    from clover.data.mix import PackedStream

    tok = ctok.load_tokenizer(stream_args["tokenizer"])
    s = PackedStream(**{**stream_args, "task_fraction": 1.0, "batch_size": 1, "seq_len": 2048})
    ids = [int(i) for i in next(s)[0]]
    first_doc = tok.decode(ids[: ids.index(0)])
    lines = first_doc.split("\n")
    assert lines[-1] == "" and 4 <= len(lines) - 1 <= 16
    held = tasks.heldout_prompts()
    for line in lines[:-1]:
        prompt, _, answer = line.partition("== ")
        assert prompt + "== " not in held
        ast.parse(line)
    # files only: the stream is the files' exact text, each followed by EOS
    s = PackedStream(**{**stream_args, "task_fraction": 0.0, "batch_size": 1, "seq_len": 4096})
    ids = [int(i) for i in next(s)[0]]
    texts = {corpus.read_text(p) for p in corpus.stdlib_files("train")[:12]}
    assert tok.decode(ids[: ids.index(0)]) in texts
    h = PackedStream(**{**stream_args, "split": "heldout", "task_fraction": 1.0, "batch_size": 1, "seq_len": 2048})
    hids = [int(i) for i in next(h)[0]]
    doc = tok.decode(hids[: hids.index(0)])
    heldp = {t.prompt for t in tasks.heldout_tasks()}
    for line in doc.split("\n")[:-1]:
        assert line[: line.index("== ") + 3] in heldp


def test_task_weights_skew_training_kinds_only(stream_args):
    import collections
    import random

    w = tasks.check_task_weights({"add": 9.0, "sum": 0})
    assert w["add"] == 9.0 and w["sum"] == 0.0 and w["sorted"] == 1.0
    counts = collections.Counter(t.kind for t, _ in zip(tasks.iter_tasks(random.Random(0), weights={"add": 9.0, "sum": 0}), range(3000)))
    assert counts["sum"] == 0
    assert counts["add"] > 5 * counts["sorted"]  # expected 9x
    assert tasks.check_task_weights(None) is None and tasks.check_task_weights({}) is None
    with pytest.raises(ValueError, match="unknown task kind"):
        tasks.check_task_weights({"addition": 2.0})
    with pytest.raises(ValueError, match=">= 0"):
        tasks.check_task_weights({"add": -1})
    pytest.importorskip("torch")
    from clover.data.mix import PackedStream

    with pytest.raises(ValueError, match="training streams only"):
        PackedStream(**{**stream_args, "split": "heldout", "max_files": None}, task_weights={"add": 2.0})
    s = PackedStream(**stream_args, task_weights={"add": 2.0})
    plain = PackedStream(**stream_args)
    state = s.state_dict()
    with pytest.raises(ValueError, match="mismatch"):
        plain.load_state_dict(state)  # a changed mix is not silently resumed


def test_lists_mix_single_digits_and_two_digits(stream_args):
    import random

    rng = random.Random(0)
    lists = [tasks._ints(rng) for _ in range(4000)]
    small = sum(max(xs) < 10 for xs in lists) / len(lists)
    assert 0.22 < small < 0.30  # SMALL_LIST_FRACTION, plus the odd two-digit list that drew only digits
    assert all(2 <= len(xs) <= 8 and max(xs) < 100 for xs in lists)
    held = [t for t in tasks.heldout_tasks(400) if t.kind == "sorted"]
    assert any(max(ast.literal_eval(t.answer)) < 10 for t in held)  # single-digit lists are held out too
    pytest.importorskip("torch")
    from clover.data.mix import PackedStream

    s = PackedStream(**stream_args)
    state = s.state_dict()
    assert state["config"]["tasks_version"] == tasks.TASKS_VERSION
    state["config"]["tasks_version"] = tasks.TASKS_VERSION - 1  # saved by older generators
    with pytest.raises(ValueError, match="mismatch"):
        PackedStream(**stream_args).load_state_dict(state)
