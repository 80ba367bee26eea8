"""The step says what it is: an engine describes a cached forward as a frozen `step.Step` (its kind,
segments, what to return), the model dispatches on it (`run_step`; the compiled graph of its kind
where the shapes fit, `static.graph_kind`), and the model answers which widths run on graphs
(`compiled`, `has_graph`)."""

import pytest
import torch

import clover
from clover.models.compile import compile_model, is_compiled
from clover.models.step import Step
from clover.models.static import CAPACITY_QUANTUM, graph_kind


def _ids(*shape, seed=0):
    return torch.randint(3, 250, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind, parts, match", [
    ("commit", dict(denoise_ids=_ids(1, 4)), "a commit step has denoise_ids"),
    ("denoise", dict(commit_ids=_ids(1, 4)), "a denoise step has commit_ids"),
    ("commit+denoise", dict(commit_ids=_ids(1, 4)), "a commit\\+denoise step has commit_ids$"),
    ("verify", dict(denoise_ids=_ids(1, 4)), "a verify step has denoise_ids"),
    ("prefill", dict(commit_ids=_ids(1, 4)), "step kind 'prefill': expected one of commit, denoise"),
])
def test_a_step_whose_parts_do_not_fit_its_kind_is_refused(kind, parts, match):
    with pytest.raises(ValueError, match=match) as e:
        Step(kind, **parts)
    assert "\n" not in str(e.value)


def test_the_graph_serving_a_step_is_its_kinds_where_the_shapes_fit():
    one, block, n = _ids(2, 1), _ids(2, 4), torch.tensor([4, 2])
    assert graph_kind(Step("commit", one)) == "ar"
    assert graph_kind(Step("commit", _ids(2, 7))) is None  # a prompt: its length would be one graph more
    assert graph_kind(Step("commit", one, n_commit=torch.tensor([1, 0]))) is None
    assert graph_kind(Step("denoise", denoise_ids=block)) == "denoise"
    assert graph_kind(Step("commit+denoise", block, n, block)) == "commit+denoise"
    assert graph_kind(Step("commit+denoise", _ids(2, 7), denoise_ids=block)) is None  # a prompt and its first block
    assert graph_kind(Step("verify", block, denoise_ids=block, all_logits=True)) == "verify"
    assert graph_kind(Step("verify", block, all_logits=True)) == "verify-commit"
    assert graph_kind(Step("verify", block, n, all_logits=True)) is None
    assert graph_kind(Step("denoise", denoise_ids=block, all_logits=True)) is None


def test_run_step_equals_the_keyword_step(tiny_llm):
    """`run_step(cache, Step(...))` and `step(cache, **fields)` are one forward: the same logits,
    the same cache; the hidden layers come back in the output (and in a caller's `hidden_out`)."""
    m = tiny_llm.model
    prompt, block = _ids(2, 9), torch.full((2, 4), tiny_llm.config.mask_token_id)
    with torch.inference_mode():
        a, b = m.make_cache(2, 32), m.make_cache(2, 32)
        m.run_step(a, Step("commit", prompt))
        m.step(b, commit_ids=prompt)
        hidden = dict.fromkeys((0, 1))
        typed = m.run_step(a, Step("commit+denoise", prompt[:, :4], denoise_ids=block, all_logits=True,
                                   hidden_layers=(0, 1)))
        kw = m.step(b, kind="commit+denoise", commit_ids=prompt[:, :4], denoise_ids=block, all_logits=True,
                    hidden_out=hidden)
    assert torch.equal(typed.commit_logits, kw.commit_logits) and torch.equal(typed.denoise_logits, kw.denoise_logits)
    assert set(typed.hidden) == {0, 1} and all(torch.equal(typed.hidden[i], hidden[i]) for i in hidden)
    assert typed.hidden[0].shape == (2, 4, tiny_llm.config.hidden_size)
    assert torch.equal(a.lengths, b.lengths) and a.lengths.tolist() == [13, 13]


def test_a_verify_step_needs_a_recording_cache(tiny_llm):
    m = tiny_llm.model
    with torch.inference_mode():
        cache = m.make_cache(1, 16)
        with pytest.raises(ValueError, match="a verify step needs a recording cache"):
            m.run_step(cache, Step("verify", _ids(1, 4), all_logits=True))
        cache.start_recording()
        out = m.step(cache, commit_ids=_ids(1, 4), all_logits=True)  # a commit while recording: a verify
    assert out.commit_logits.shape[:2] == (1, 4) and cache.record is not None


def test_the_model_answers_which_widths_have_graphs(tiny_dir, monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    llm = clover.load(tiny_dir)
    assert not llm.model.compiled and not llm.model.has_graph("verify", 4) and not is_compiled(llm.model)
    compile_model(llm.model)
    m = llm.model
    assert m.compiled and is_compiled(m) and not hasattr(m, "_clover_compiled")
    assert m.has_graph("verify", 4) and m.has_graph("denoise", 16)  # not frozen: any width compiles on first use
    m.static_steps.warm_all([("ar", 1, 1, CAPACITY_QUANTUM, False, ()), ("verify", 1, 4, CAPACITY_QUANTUM, True, ())])
    assert m.has_graph("verify", 4) and m.has_graph("commit", 1)
    assert not m.has_graph("verify", 8) and not m.has_graph("denoise", 4) and not m.has_graph("commit+denoise", 4)
