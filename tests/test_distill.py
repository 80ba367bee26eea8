"""Self-distillation sets: built from the model's own AR greedy output, mixed into the stream."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from clover.data import tasks
from clover.data.distill import DistillSet, build_distill_set, distill_prompts, ensure_distill_set, load_distill_set
from clover.data.mix import PackedStream


@pytest.fixture(scope="module")
def bundled():
    import clover

    return clover.load()


def test_prompts_never_held_out():
    task_prompts, code_prompts = distill_prompts(200, 3, seed=1)
    held = tasks.heldout_prompts()
    assert len(task_prompts) == 200 and not set(task_prompts) & held
    assert len(code_prompts) == 3 and all(h.lstrip().startswith(("def ", "async def ")) for h in code_prompts)


def test_build_is_ar_greedy_and_round_trips(bundled, tmp_path):
    d = build_distill_set(bundled, tmp_path / "set", n_tasks=6, n_code=1, task_tokens=12, code_tokens=8,
                          batch_size=4, progress=False)
    task_prompts, code_prompts = distill_prompts(6, 1, seed=0)
    for p, line in zip(task_prompts, d.task_lines):
        ref = bundled.generate(p, mode="ar", max_new_tokens=12, stop=["\n"])
        assert line == p + ref.text and "\n" not in line  # the teacher's own greedy answer
    assert d.code_docs[0].startswith(code_prompts[0])
    again = load_distill_set(tmp_path / "set")
    assert (again.task_lines, again.code_docs, again.digest) == (d.task_lines, d.code_docs, d.digest)
    rows = [json.loads(x) for x in (tmp_path / "set" / "distill.jsonl").read_text().splitlines()]
    assert {r["kind"] for r in rows} == {"task", "code"}
    (tmp_path / "set" / "meta.json").write_text("{}")
    with pytest.raises(ValueError, match="delete it to rebuild"):
        load_distill_set(tmp_path / "set")


def test_task_continuations_past_the_line(bundled, tmp_path):
    """`task_line=False`: a task's row is the decode a drafter meets after a task prompt with no stop
    string (`task_tokens` greedy tokens, past the answer line)."""
    d = build_distill_set(bundled, tmp_path / "set", n_tasks=3, n_code=0, task_tokens=24, batch_size=2,
                          progress=False, task_line=False)
    for p, doc in zip(distill_prompts(3, 0, seed=0)[0], d.task_lines):
        assert doc == p + bundled.generate(p, mode="ar", max_new_tokens=24).text
    assert any("\n" in doc for doc in d.task_lines) and load_distill_set(tmp_path / "set").meta["task_line"] is False


def test_interrupted_build_continues(bundled, tmp_path):
    """A build killed after its first batch (and mid-line) resumes from the part file: it decodes only
    the rest, and the set equals an uninterrupted build's."""
    kw = dict(n_tasks=5, n_code=1, task_tokens=10, code_tokens=6, batch_size=2, progress=False)
    whole = build_distill_set(bundled, tmp_path / "whole", **kw)

    class Killed(Exception):
        pass

    class DiesAfterOneBatch:
        def __init__(self, llm):
            self.llm, self.tokenizer, self.calls = llm, llm.tokenizer, 0

        def generate(self, prompts, **k):
            self.calls += 1
            if self.calls > 1:
                raise Killed
            return self.llm.generate(prompts, **k)

    with pytest.raises(Killed):
        build_distill_set(DiesAfterOneBatch(bundled), tmp_path / "cut", **kw)
    part = tmp_path / "cut" / "distill.jsonl.part"
    assert len(part.read_text().splitlines()) == 1 + 2 and not (tmp_path / "cut" / "meta.json").exists()
    with open(part, "a") as f:
        f.write('{"kind": "task", "te')  # torn by the kill
    seen = []

    class Counting(DiesAfterOneBatch):
        def generate(self, prompts, **k):
            seen.extend(prompts)
            return self.llm.generate(prompts, **k)

    again = build_distill_set(Counting(bundled), tmp_path / "cut", **kw)
    task_prompts, code_prompts = distill_prompts(5, 1, seed=0)
    assert seen == task_prompts[2:] + code_prompts  # the first batch was not decoded again
    assert (again.task_lines, again.code_docs, again.digest) == (whole.task_lines, whole.code_docs, whole.digest)
    assert not part.exists()
    # another count keeps the rows of the prompts both builds share; another token limit keeps none
    for other, reused in (({"n_tasks": 4}, 2), ({"task_tokens": 9}, 0)):
        shutil.rmtree(tmp_path / "other", ignore_errors=True)
        with pytest.raises(Killed):
            build_distill_set(DiesAfterOneBatch(bundled), tmp_path / "other", **kw)
        seen.clear()
        build_distill_set(Counting(bundled), tmp_path / "other", **{**kw, **other})
        assert seen[0] == distill_prompts(5, 1, seed=0)[0][reused]


def test_a_set_grows_at_a_larger_count(bundled, tmp_path):
    """`ensure_distill_set` asked for more prompts than a finished set holds keeps its rows and decodes
    only the new prompts (a long run starts training on a first part); fewer, or other token
    limits, leave the set as it is."""
    kw = dict(n_tasks=3, n_code=1, task_tokens=10, code_tokens=6, batch_size=2, progress=False)
    small = ensure_distill_set(tmp_path / "set", lambda: bundled, **kw)
    seen = []

    class Counting:
        tokenizer = bundled.tokenizer

        def generate(self, prompts, **k):
            seen.extend(prompts)
            return bundled.generate(prompts, **k)

    assert ensure_distill_set(tmp_path / "set", Counting, **{**kw, "n_tasks": 2}).digest == small.digest
    assert ensure_distill_set(tmp_path / "set", Counting, **{**kw, "n_tasks": 5, "task_tokens": 9}).digest == small.digest
    assert seen == []
    grown = ensure_distill_set(tmp_path / "set", Counting, **{**kw, "n_tasks": 5})
    task_prompts, _ = distill_prompts(5, 1, seed=0)
    assert seen == task_prompts[3:]
    whole = build_distill_set(bundled, tmp_path / "whole", **{**kw, "n_tasks": 5})
    assert (grown.task_lines, grown.code_docs, grown.digest) == (whole.task_lines, whole.code_docs, whole.digest)


def test_instructions_are_a_prefix_of_more():
    from clover.data.instructions import instructions

    assert instructions("train", 300, seed=3)[:40] == instructions("train", 40, seed=3)


def test_stream_mixes_the_set(tmp_path):
    from clover.data import tokenizer as ctok

    tok_dir = tmp_path / "tok"
    ctok.train_tokenizer(tok_dir, vocab_size=300, max_chars=40_000, n_task_lines=100, verbose=False)
    marker = "assert zz(1) == 777"
    d = DistillSet([marker], [], {"digest": "abc"})
    args = dict(tokenizer=tok_dir, seq_len=64, batch_size=2, seed=3, cache_dir=tmp_path / "c", max_files=4)
    tok = ctok.load_tokenizer(tok_dir)
    plain = PackedStream(**args)
    base = plain.next_batch()
    # fraction 0 (or no set) leaves the stream exactly as it was
    same = PackedStream(**args, distill=d, distill_fraction=0.0)
    assert torch.equal(same.next_batch(), base) and "distill" not in same.state_dict()["config"]
    only = PackedStream(**args, distill=d, distill_fraction=1.0)
    text = tok.decode(only.next_batch()[0].tolist(), skip_special_tokens=False)
    assert marker in text and text.count(marker) >= 3
    assert only.state_dict()["config"]["distill"] == "abc"
    with pytest.raises(ValueError, match="non-empty"):
        PackedStream(**args, distill=DistillSet([], [], {"digest": "x"}), distill_fraction=0.5)


def test_rows_end_a_block_after_the_longest_row():
    """`DistillRows(min_len=, tail=)`: a batch is cut after its longest row and `tail` columns of padding
    follow, so a drafter's anchor on that row's last tokens still has its whole block in the batch."""
    from clover.api import BUNDLED_MODEL
    from clover.data.distill import DistillRows

    d = DistillSet(["assert 1 + 2 == 3", "assert min([4, 5]) == 4"], [], {"digest": "abc"})
    args = dict(seq_len=64, batch_size=4, seed=0, task_fraction=1.0, pad_id=1, min_len=17)
    plain = DistillRows(d, BUNDLED_MODEL, **args).next_batch()
    tailed = DistillRows(d, BUNDLED_MODEL, **args, tail=15).next_batch()
    used = int((plain != 1).any(0).nonzero().max()) + 1
    assert plain.shape[1] == max(used, 17) and tailed.shape[1] == used + 15
    assert torch.equal(tailed[:, :used], plain[:, :used]) and (tailed[:, used:] == 1).all()
