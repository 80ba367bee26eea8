"""A `clover quantize` directory as torchao tensors for the transformers export (`clover export-hf`).

INT8 (symmetric per output channel) is torchao's `Int8Tensor` as `Int8WeightOnlyConfig(version=2)`
makes it: `qdata` = clover's `qweight` (int8 [N, K]), `scale` = clover's `scales` as [N, 1], zero
points 0 — the same weights bit for bit, and the same arithmetic in the weight-only matmul
(x @ q^T, then times the row scale). The routed experts are 3-D `Int8Tensor`s [E, N, K] (torchao
indexes one expert out of them). The files are torchao's safetensors layout (`_weight_qdata`,
`_weight_scale`, ... plus JSON metadata per tensor), and config.json carries transformers'
`TorchAoConfig`, so `AutoModelForCausalLM.from_pretrained(DST, trust_remote_code=True)` loads the
quantized weights through transformers' own torchao quantizer. A quantized embedding or lm_head is
written dequantized (transformers' torchao path quantizes those only on request): the rows clover
computes with, exactly.

INT4 is refused: clover's INT4 is (q - 8) * scale + zero with a float zero per group (tinygemm's
convention), which torchao holds only in tensors whose matmul needs a CUDA kernel (`Int4Tensor`:
mslk; `Int4TilePackedTo4dTensor`: tinygemm on compute capability 8.0+); its CPU format
(`IntxUnpackedToInt8Tensor`) has an integer-domain zero point and cannot index one expert out of a
3-D weight (`aten.select` is not implemented for it).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import CloverConfig, ConfigError

EXTRA = "torchao"  # pyproject extra: pip install 'clover-dlm[torchao]'


def torchao_export(src: Path, config: CloverConfig) -> tuple[dict[str, torch.Tensor], dict[str, str], dict, list[str]]:
    """-> (flattened tensors, safetensors metadata, config.json's quantization_config, notes) for the
    quantized checkpoint `src` (INT8 only; see the module docstring)."""
    from ..quant.format import EMBEDDING, LM_HEAD, parse_quantization_config
    from ..quant.ops import dequantize_int4, dequantize_int8
    from safetensors.torch import load_file

    from ..weights import shard_files

    bits, group, targets = parse_quantization_config(config.quantization_config, config, str(src / "config.json"))
    if bits != 8:
        raise ConfigError(f"{src}: an INT4 checkpoint cannot be exported for transformers: torchao holds clover's "
                          "INT4 (a float zero per group) only in CUDA-kernel tensors, and its CPU int4 tensor cannot "
                          "index one expert of the fused expert weights; export the INT8 or the float checkpoint "
                          "(docs/transformers.md)")
    try:
        from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict
        from torchao.quantization import Int8WeightOnlyConfig
        from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor
        from transformers import TorchAoConfig
    except ImportError as e:
        raise ConfigError(f"exporting a quantized checkpoint for transformers needs torchao ({e}); "
                          f"pip install 'clover-dlm[{EXTRA}]'") from None

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(config.torch_dtype or "", torch.float32)
    raw: dict[str, torch.Tensor] = {}
    for path in shard_files(src):
        raw.update(load_file(str(path)))
    state: dict[str, torch.Tensor] = {}
    notes: list[str] = []
    quantized_keys = set()
    for name, t in targets.items():
        for wname in t.weight_shapes():
            base = wname.removesuffix(".weight")
            q, s = raw[f"{base}.qweight"], raw[f"{base}.scales"]
            quantized_keys |= {f"{base}.qweight", f"{base}.scales", f"{base}.zeros"}
            if name in (EMBEDDING, LM_HEAD):  # the rows clover computes with, in its compute dtype
                state[wname] = (dequantize_int8(q, s) if bits == 8 else dequantize_int4(q, s, raw[f"{base}.zeros"], t.k))
                notes.append(f"{name}: written dequantized (transformers quantizes embeddings only on request)")
                continue
            lead = q.shape[:-1]
            state[wname] = Int8Tensor(q.contiguous(), s.float().reshape(*lead, 1), [1] * (q.dim() - 1) + [q.shape[-1]],
                                      dtype, zero_point=torch.zeros(*lead, 1, dtype=torch.int8))
    for k, v in raw.items():
        if k not in quantized_keys:
            state[k] = v
    flat, metadata = flatten_tensor_state_dict(state)
    qc = TorchAoConfig(quant_type=Int8WeightOnlyConfig(version=2)).to_dict()
    return flat, metadata, qc, notes
