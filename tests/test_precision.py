"""clover.precision: float32 where the machine has no native half-precision matmul (loading and training)."""

import pytest
import torch

import clover.api as api
import clover.precision as precision
from clover.tiny import build_tiny_checkpoint
from clover.train.trainer import resolve_autocast


def test_native_half_matmul_answers_and_rejects_full_precision():
    assert isinstance(precision.native_half_matmul(torch.bfloat16, "cpu"), bool)
    assert isinstance(precision.cpu_capability(), str)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        precision.native_half_matmul(torch.float32, "cpu")


@pytest.mark.parametrize("native", [True, False])
def test_resolve_autocast(monkeypatch, native):
    monkeypatch.setattr(precision, "native_half_matmul", lambda dtype, device: native)
    cpu = torch.device("cpu")
    on, note = resolve_autocast("auto", cpu)
    assert on is native and (note is None) is native
    if not native:
        assert "float32" in note
    on, note = resolve_autocast("bf16", cpu)  # explicit bf16 is honoured, with a warning where slow
    assert on and (note is None) is native
    if not native:
        assert note.startswith("warning") and "'auto'" in note
    assert resolve_autocast("none", cpu) == (False, None)


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("bf16"), dtype=torch.bfloat16)


def test_load_upcasts_half_checkpoints_without_native_matmul(monkeypatch, bf16_dir):
    monkeypatch.setattr(precision, "native_half_matmul", lambda dtype, device: False)
    assert api.load(bf16_dir).model.dtype == torch.float32
    assert api.load(bf16_dir, dtype="bfloat16").model.dtype == torch.bfloat16  # an explicit dtype wins
    monkeypatch.setattr(precision, "native_half_matmul", lambda dtype, device: True)
    assert api.load(bf16_dir).model.dtype == torch.bfloat16  # native: the stored dtype


def test_load_warns_when_float32_would_not_fit(monkeypatch, bf16_dir):
    monkeypatch.setattr(precision, "native_half_matmul", lambda dtype, device: False)
    monkeypatch.setattr(api.os, "sysconf", lambda name: 1)  # 1 byte available
    with pytest.warns(UserWarning, match="no native bfloat16 matmul.*dtype='float32'"):
        llm = api.load(bf16_dir)
    assert llm.model.dtype == torch.bfloat16
