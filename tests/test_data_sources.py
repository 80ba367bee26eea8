"""`[[data.sources]]`: local text files, JSON Lines and `datasets` saved with save_to_disk, mixed by
weight into the packed stream; held-out documents kept apart; resumable; the stdlib alone as before."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from clover.data.mix import PackedStream
from clover.data.sources import Source, SourceError, heldout, parse_sources, read_documents
from clover.train.recipes import RecipeError, load_recipe

BUNDLED = Path(__file__).resolve().parents[1] / "src" / "clover" / "assets" / "clover-tiny"
MARKS = {"text": "Zebra", "jsonl": "Quokka", "datasets": "Narwhal"}  # one word per source, to count its documents


def _write_sources(root: Path, n: int = 60) -> dict[str, Path]:
    (root / "txt").mkdir(parents=True)
    for i in range(n):
        (root / "txt" / f"doc{i}.txt").write_text(f"{MARKS['text']} note {i}: the quick brown fox.\n")
    (root / "txt" / ".hidden").write_text("never read")
    with open(root / "rows.jsonl", "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": f"{MARKS['jsonl']} row {i} of the table.", "id": i}) + "\n")
        f.write("\n")  # blank lines are skipped
    out = {"text": root / "txt", "jsonl": root / "rows.jsonl"}
    datasets = pytest.importorskip("datasets", reason="the datasets source needs `datasets` (pip install 'clover-dlm[data]')")
    ds = datasets.Dataset.from_dict({"body": [f"{MARKS['datasets']} record {i}." for i in range(n)], "n": list(range(n))})
    datasets.DatasetDict({"train": ds}).save_to_disk(str(root / "saved"))
    out["datasets"] = root / "saved"
    return out


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return _write_sources(tmp_path_factory.mktemp("sources"))


def _sources(paths, weights=(1.0, 1.0, 1.0)):
    return parse_sources([{"kind": "text", "path": str(paths["text"]), "weight": weights[0]},
                          {"kind": "jsonl", "path": str(paths["jsonl"]), "weight": weights[1]},
                          {"kind": "datasets", "path": str(paths["datasets"]), "field": "body", "weight": weights[2]}])


def test_read_documents_and_the_heldout_split(paths):
    srcs = _sources(paths)
    for src in srcs:
        train, held = read_documents(src, "train"), read_documents(src, "heldout")
        assert len(train) + len(held) == 60  # every document in exactly one split
        assert all(not heldout(n) for n, _ in train) and all(heldout(n) for n, _ in held)
        assert all(MARKS[src.kind] in t for _, t in train)
    assert not any("never read" in t for _, t in read_documents(srcs[0]))
    # a JSON Lines document is named by its file and line (which split a line lands in hangs on the path)
    names = [n for split in ("train", "heldout") for n, _ in read_documents(srcs[1], split)]
    assert sorted(int(n.rsplit(":", 1)[1]) for n in names) == list(range(1, 61))
    assert all(n.rsplit(":", 1)[0].endswith("rows.jsonl") for n in names)


def _count(stream, batches: int, tok) -> dict[str, int]:
    ids = {k: tok.token_to_id(v) or tok.encode(v).ids[0] for k, v in MARKS.items()}
    counts = dict.fromkeys(MARKS, 0)
    for _ in range(batches):
        b = stream.next_batch().numpy()
        for k, t in ids.items():
            counts[k] += int((b == t).sum())
    return counts


def test_stream_mixes_the_sources_by_weight_and_resumes(paths, tmp_path):
    args = dict(tokenizer=BUNDLED, seq_len=64, batch_size=4, task_fraction=0.0, seed=1, cache_dir=tmp_path)
    s = PackedStream(**args, sources=_sources(paths, (1.0, 1.0, 6.0)))
    counts = _count(s, 30, s.tok)
    assert all(counts.values()), counts
    assert counts["datasets"] > 2 * max(counts["text"], counts["jsonl"])  # weight 6 against 1 and 1
    # resumable: a fresh stream loaded with the state continues with the same batches
    state = json.loads(json.dumps(s.state_dict()))
    want = [s.next_batch() for _ in range(3)]
    r = PackedStream(**args, sources=_sources(paths, (1.0, 1.0, 6.0)))
    r.load_state_dict(state)
    assert all(np.array_equal(a.numpy(), r.next_batch().numpy()) for a in want)
    # another mix is another configuration: resuming across it is refused
    other = PackedStream(**args, sources=_sources(paths, (1.0, 2.0, 6.0)))
    with pytest.raises(ValueError, match="mismatch"):
        other.load_state_dict(state)


def test_sources_with_tasks(paths, tmp_path):
    s = PackedStream(BUNDLED, seq_len=64, batch_size=2, task_fraction=0.5, seed=0, cache_dir=tmp_path,
                     sources=_sources(paths)[:1])
    text = "".join(s.tok.decode(s.next_batch()[r].tolist()) for _ in range(10) for r in range(2))
    assert MARKS["text"] in text and "assert " in text


def test_the_stdlib_alone_is_the_stream_it_always_was(tmp_path):
    args = dict(tokenizer=BUNDLED, seq_len=32, batch_size=2, task_fraction=0.3, seed=3, cache_dir=tmp_path, max_files=6)
    a, b = PackedStream(**args), PackedStream(**args, sources=[Source("stdlib")])
    for _ in range(4):
        assert np.array_equal(a.next_batch().numpy(), b.next_batch().numpy())
    assert "sources" not in a.state_dict()["config"] and isinstance(a.state_dict()["rows"][0]["files_before"], int)


def test_recipe_sources_resolve_against_the_recipe(paths, tmp_path):
    rdir = tmp_path / "recipes"
    rdir.mkdir()
    (rdir / "r.toml").write_text(f'''
name = "mine"
init = "{BUNDLED}"
[data]
tokenizer = "{BUNDLED}"
[[data.sources]]
kind = "jsonl"
path = "{paths['jsonl']}"
weight = 3
[[data.sources]]
kind = "stdlib"
''')
    r = load_recipe(rdir / "r.toml")
    assert [s["kind"] for s in r.data.sources] == ["jsonl", "stdlib"] and r.data.sources[0]["weight"] == 3.0
    json.dumps(r.to_dict())  # the run directory's recipe.json holds them
    (rdir / "local.jsonl").write_text('{"text": "hi"}\n')
    (rdir / "rel.toml").write_text(f'init = "{BUNDLED}"\n[[data.sources]]\nkind = "jsonl"\npath = "local.jsonl"\n')
    assert load_recipe(rdir / "rel.toml").data.sources[0]["path"] == str(rdir / "local.jsonl")


@pytest.mark.parametrize("source, message", [
    ({"kind": "csv", "path": "x"}, "kind must be one of"),
    ({"kind": "text"}, "needs a path"),
    ({"kind": "stdlib", "path": "x"}, "takes no path"),
    ({"kind": "text", "path": "x", "weight": 0}, "weight must be a number > 0"),
    ({"kind": "text", "path": "x", "colour": 1}, "unknown key"),
])
def test_bad_sources_are_one_line_errors(source, message, tmp_path):
    (tmp_path / "r.toml").write_text(f'init = "{BUNDLED}"\n[[data.sources]]\n'
                                     + "".join(f"{k} = {json.dumps(v)}\n" for k, v in source.items()))
    with pytest.raises(RecipeError, match=message) as e:
        load_recipe(tmp_path / "r.toml")
    assert "data.sources[0]" in str(e.value) and "\n" not in str(e.value)


def test_unreadable_source_contents_name_the_place(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(SourceError, match=r"bad.jsonl:2: not a JSON object"):
        read_documents(Source("jsonl", str(tmp_path / "bad.jsonl")))
    (tmp_path / "other.jsonl").write_text('{"body": "ok"}\n')
    with pytest.raises(SourceError, match="no string field 'text'"):
        read_documents(Source("jsonl", str(tmp_path / "other.jsonl")))
    with pytest.raises(SourceError, match="no such file"):
        read_documents(Source("text", str(tmp_path / "nothing-*.txt")))
