"""Read a GGUF file as a model directory (`clover import-gguf FILE.gguf OUT_DIR`).

A GGUF of llama.cpp's `llama` architecture (SmolLM2, TinyLlama, Llama 3.x)
becomes the Hugging Face layout clover and transformers load: `config.json`, `model.safetensors`
(dequantized by the `gguf` package: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants
it implements), `tokenizer.json` and `tokenizer_config.json` with the chat template, all rebuilt
from the file's metadata.

What llama.cpp's converter (`convert_hf_to_gguf.py`, `LlamaModel`) changed is undone here:
- tensor names (`blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight`, ...: `names.LLAMA`);
- the q_proj and k_proj rows (and biases) were permuted per head from the rotate-half layout to
  interleaved pairs (`permute(w, n_head, n_head_kv)`); the inverse permutation restores them;
- no `output.weight`: the embeddings are tied;
- llama3 RoPE scaling became a tensor of per-frequency factors (`rope_freqs.weight`); the
  `rope_scaling` parameters that give the same factors are recovered from it.
The tokenizer: `tokenizer.ggml.model = gpt2` is byte-level BPE (tokens, merges, token types: control
and user-defined tokens become added tokens), with the pre-tokenizer that `tokenizer.ggml.pre` names
(gpt-2, smollm: individual digits, then the GPT-2 regex).

A GGUF of `qwen35moe` as clover's exporter writes it (`clover export-gguf`, docs/gguf.md) comes
back as the checkpoint it was written from: the exporter's transforms are undone (norm weights
stored as 1 + w, `ssm_a = -exp(A_log)`, value heads tiled for ggml, the conv as [C, K], the fused
experts split in two, the shared-expert gate squeezed: each row's inverse in the table both
directions read, `names.QWEN35MOE`), the Clover tensors are read from the sidecar file
the metadata names (or inline), and the `clover.*` keys give the block-diffusion settings back; the
tokenizer's `qwen2` / `qwen35` pre-tokenizers are rebuilt, and the exporter's padding tokens and
placeholder merge dropped. An f32 export round-trips bit for bit.

A file that cannot be imported stops with one line that says why and names the tensor or key:
an unsupported architecture or tensor type, a truncated file, a tensor of the wrong shape.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..config import CloverConfig
from ..models import build_model, config_from_dict
from ..weights import expected_shapes, save_state_dict
from .names import (BLOCK, FLOAT_KEYS, FUSED_GATE_UP, LLAMA, QWEN35MOE, SPLIT_EXPERTS, TABLES, GGUFImportError, Heads,
                    layer_entry)
from .tokenizer import QWEN2_REGEX, QWEN35_REGEX

ARCHITECTURES = tuple(TABLES)  # the architectures a table names (`names.TABLES`)
# the types `gguf.quants.dequantize` implements that a model file is expected to hold
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
PRE_TOKENIZERS = ("gpt-2", "gpt2", "smollm", "default", "qwen2", "qwen35")

# ----------------------------------------------------------------------------- reading
def _reader(path: Path):
    import gguf

    class Reader(gguf.GGUFReader):
        # the file as a plain array over the same mapping: the reader slices it once per metadata element
        # (a tokenizer's ~100k strings), and each slice of an np.memmap pays its subclass bookkeeping
        # (SmolLM2-135M's GGUF: read in 3 s instead of 11)
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = value.view(np.ndarray)

        def _build_tensors(self, start_offs, fields):  # name the tensor a truncated file cuts off
            for field in fields:
                _, name_data, _, dims, raw_dtype, offset = field.parts
                name = bytes(name_data).decode("utf-8", "replace")
                try:
                    qtype = gguf.GGMLQuantizationType(int(raw_dtype[0]))
                except ValueError:
                    raise GGUFImportError(f"{path}: tensor {name!r} has an unknown type id {int(raw_dtype[0])}") from None
                block, size = gguf.GGML_QUANT_SIZES[qtype]
                end = int(start_offs + offset[0]) + int(np.prod(dims)) * size // block
                if end > len(self.data):
                    raise GGUFImportError(
                        f"{path}: truncated file: tensor {name!r} ends at byte {end} but the file has {len(self.data)}; "
                        "download it again")
            return super()._build_tensors(start_offs, fields)

    if not path.is_file():
        raise GGUFImportError(f"{path}: no such file")
    try:
        return Reader(str(path))
    except GGUFImportError:
        raise
    except Exception as e:  # noqa: BLE001 - the reader raises ValueError/struct errors on a damaged header
        raise GGUFImportError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _f32(v) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(v)))


def _require(reader, path: Path, key: str):
    v = _field(reader, key)
    if v is None:
        raise GGUFImportError(f"{path}: metadata key {key!r} is missing; the file does not describe a whole model")
    return v


def dequantize(tensor, path: Path) -> torch.Tensor:
    """One GGUF tensor -> float32 in PyTorch order ([out, in] for a matrix)."""
    import gguf

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise GGUFImportError(f"{path}: tensor {tensor.name!r} is stored as {kind}, which import-gguf cannot dequantize "
                              f"(supported: {', '.join(SUPPORTED_TYPES)}); convert the file with llama-quantize first")
    try:
        a = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    except NotImplementedError:
        raise GGUFImportError(f"{path}: tensor {tensor.name!r}: the gguf package cannot dequantize {kind}") from None
    shape = tuple(int(x) for x in reversed(tensor.shape))
    return torch.from_numpy(np.array(a, dtype=np.float32).reshape(shape))  # a copy: writable, off the mmap


# ----------------------------------------------------------------------------- config
def llama_config(reader, path: Path, tensor_names: set[str]) -> CloverConfig:
    a = "llama"
    heads = int(_require(reader, path, f"{a}.attention.head_count"))
    hidden = int(_require(reader, path, f"{a}.embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = int(_field(reader, f"{a}.vocab_size", len(tokens) if tokens else 0))
    if not vocab:
        raise GGUFImportError(f"{path}: neither {a}.vocab_size nor tokenizer.ggml.tokens gives the vocabulary size")
    head_dim = int(_field(reader, f"{a}.attention.key_length", hidden // heads))
    rot = int(_field(reader, f"{a}.rope.dimension_count", head_dim))
    if rot != head_dim:
        raise GGUFImportError(f"{path}: {a}.rope.dimension_count is {rot} but the head dim is {head_dim}; "
                              "partial rotary llama files are not supported")
    fields = dict(
        model_type="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(_require(reader, path, f"{a}.feed_forward_length")),
        num_hidden_layers=int(_require(reader, path, f"{a}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, f"{a}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=_f32(_field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32(_field(reader, f"{a}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(reader, f"{a}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        mlp_bias="blk.0.ffn_up.bias" in tensor_names,
        torch_dtype="float32",
    )
    scaling = _field(reader, f"{a}.rope.scaling.type")
    if "rope_freqs.weight" in tensor_names:
        if scaling and scaling != "none":
            raise GGUFImportError(f"{path}: tensor 'rope_freqs.weight' and {a}.rope.scaling.type {scaling!r} together "
                                  "are not supported (llama3 RoPE factors alone are)")
        freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        fields["rope_scaling"] = llama3_rope_from_factors(dequantize(freqs, path).reshape(-1), fields["rope_theta"],
                                                          head_dim, path)
    elif scaling and scaling != "none":
        if scaling != "linear":
            raise GGUFImportError(f"{path}: {a}.rope.scaling.type {scaling!r} is not supported (none or linear)")
        fields["rope_scaling"] = {"rope_type": "linear", "factor": float(_require(reader, path, f"{a}.rope.scaling.factor"))}
    ids = {k: _field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")}
    fields["bos_token_id"] = None if ids["bos"] is None else int(ids["bos"])
    fields["pad_token_id"] = None if ids["padding"] is None else int(ids["padding"])
    fields["eos_token_id"] = end_of_generation_ids(reader)
    return config_from_dict(fields, source=str(path))


def llama3_rope_from_factors(factors: torch.Tensor, theta: float, head_dim: int, path: Path) -> dict | None:
    """`rope_freqs.weight` (what llama.cpp's converter writes for `rope_type: llama3`: per frequency,
    the divisor of the inverse frequency) -> the llama3 `rope_scaling` that gives back those factors.

    The factors are 1 at high frequencies, `factor` at low ones, and 1 / ((1 - s) / factor + s) in
    between, with s = (original_max / wavelength - low_freq_factor) / (high - low): s is linear in
    1 / wavelength, so two intermediate factors fix the line. Only the ratios of original_max,
    low_freq_factor and high_freq_factor are determined; low_freq_factor = 1 (Llama 3's) picks the
    rest. The parameters are checked by recomputing every factor; None when all factors are 1."""
    import math

    f = factors.double()
    if f.numel() != head_dim // 2:
        raise GGUFImportError(f"{path}: tensor 'rope_freqs.weight' has {f.numel()} values but the head dim {head_dim} "
                              f"has {head_dim // 2} frequencies")
    factor = float(f.max())
    if factor == 1.0 and float(f.min()) == 1.0:
        return None
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    x = inv / (2 * math.pi)  # 1 / wavelength
    mid = (f > 1 + 1e-6) & (f < factor - 1e-6 * factor)
    if int(mid.sum()) < 2:
        raise GGUFImportError(f"{path}: tensor 'rope_freqs.weight' has {int(mid.sum())} factor(s) between 1 and "
                              f"{factor:g}; llama3 RoPE parameters cannot be recovered from it")
    s = (factor / f[mid] - 1) / (factor - 1)
    slope, icept = torch.linalg.lstsq(torch.stack([x[mid], torch.ones_like(x[mid])], 1), s[:, None]).solution[:, 0]
    if not float(icept) < 0:
        raise GGUFImportError(f"{path}: tensor 'rope_freqs.weight' is not a llama3 RoPE factor table")
    low = 1.0
    high = low - 1.0 / float(icept)  # icept = -low / (high - low)
    original = float(slope) * (high - low)  # slope = original / (high - low)
    if not (high > low and original > 0):
        raise GGUFImportError(f"{path}: tensor 'rope_freqs.weight' is not a llama3 RoPE factor table")
    from types import SimpleNamespace

    from ..models.llama import rope_inv_freq

    exact = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
             "original_max_position_embeddings": original}
    rounded = {**exact, "factor": round(factor, 6), "high_freq_factor": round(high, 4),
               "original_max_position_embeddings": round(original)}
    for rope in (rounded, exact):  # the round numbers a config holds, when they give the same factors
        got = inv.float() / rope_inv_freq(SimpleNamespace(head_dim=head_dim, rope_theta=theta, rope_scaling=rope))
        if torch.allclose(got, factors.float(), rtol=1e-4, atol=0):
            return rope
    worst = int((got - factors.float()).abs().argmax())
    raise GGUFImportError(f"{path}: tensor 'rope_freqs.weight' is not a llama3 RoPE factor table (value {worst}: "
                          f"{float(factors[worst]):g}, llama3 would give {float(got[worst]):g})")


# the token texts llama.cpp treats as end of generation besides the file's eos (llama-vocab.cpp)
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>")


def end_of_generation_ids(reader) -> list[int] | int | None:
    """The file's eos id plus the control tokens llama.cpp stops at by their text (e.g. <|im_end|>)."""
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    out = [] if eos is None else [int(eos)]
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    index = {t: i for i, t in enumerate(tokens)}
    for t in EOG_TEXTS:
        if t in index and index[t] not in out:
            out.append(index[t])
    return out[0] if len(out) == 1 else (out or None)


# ----------------------------------------------------------------------------- weights
def _complete(state: dict, expected: dict, config: CloverConfig, path: Path) -> dict:
    """`state` when it holds every parameter the model expects (a tied LM head aside), else a
    GGUFImportError naming the first missing ones."""
    missing = [k for k in expected if k not in state and not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing:
        raise GGUFImportError(f"{path}: the file lacks tensor(s) for {', '.join(missing[:3])}"
                              + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""))
    return state


def llama_state_dict(reader, path: Path, config: CloverConfig, progress: bool = True) -> dict[str, torch.Tensor]:
    from tqdm import tqdm

    expected = expected_shapes(build_model(config, device="meta"))
    layer, globals_, heads = LLAMA.read_layer(), LLAMA.read_globals(), Heads.of(config)
    state: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc="dequantize", unit="tensor", disable=not progress):
        if t.name == "rope_freqs.weight":  # read into the config's rope_scaling (llama_config)
            continue
        if t.name in globals_:
            name, undo = globals_[t.name]
        else:
            m = BLOCK.match(t.name)
            row = layer_entry(LLAMA, m.group(2), read=layer) if m else None
            if row is None:
                raise GGUFImportError(f"{path}: tensor {t.name!r} is not part of a llama model this importer knows")
            name, undo = f"model.layers.{m.group(1)}.{row[0]}", row[1]
        w = dequantize(t, path)
        want = expected.get(name)
        if want is None:
            raise GGUFImportError(f"{path}: tensor {t.name!r} ({name}) has no place in a model of this config")
        if tuple(w.shape) != tuple(want):
            raise GGUFImportError(f"{path}: tensor {t.name!r} has shape {list(w.shape)} but the metadata gives "
                                  f"{list(want)} for {name}")
        state[name] = undo(w, heads)  # the converter's q/k row permutation undone
    return _complete(state, expected, config, path)


# ----------------------------------------------------------------------------- qwen35moe
def qwen35moe_config(reader, path: Path, tensor_names: set[str]) -> CloverConfig:
    a = QWEN35MOE.arch
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFImportError(f"{path}: metadata key 'tokenizer.ggml.tokens' is missing; the vocabulary size is unknown")
    got: dict = {}  # the config attributes export writes as they are (the table's keys)
    for key, attr in QWEN35MOE.keys.items():
        if attr in got:  # head_dim: key_length and value_length
            continue
        default = {"rope.dimension_count": got.get("head_dim"), "full_attention_interval": 4}.get(key)
        v = _require(reader, path, f"{a}.{key}") if default is None else _field(reader, f"{a}.{key}", default)
        got[attr] = _f32(v) if key in FLOAT_KEYS else int(v)
    rotary, n_v, layers = got.pop("rotary_dim"), got["linear_num_value_heads"], got["num_hidden_layers"]
    recurrent = _field(reader, f"{a}.attention.recurrent_layers")
    if recurrent is None or len(recurrent) != layers:
        raise GGUFImportError(f"{path}: metadata key '{a}.attention.recurrent_layers' is missing or not one flag per "
                              f"layer ({layers})")
    fields = dict(
        model_type="qwen3_5_moe_text",
        vocab_size=len(tokens),
        **got,
        partial_rotary_factor=rotary / got["head_dim"],
        linear_value_head_dim=int(_require(reader, path, f"{a}.ssm.inner_size")) // n_v,
        layer_types=["linear_attention" if r else "full_attention" for r in recurrent],
        tie_word_embeddings="output.weight" not in tensor_names,
        torch_dtype="float32",
    )
    ids = {k: _field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "padding")}
    fields["bos_token_id"] = None if ids["bos"] is None else int(ids["bos"])
    fields["pad_token_id"] = None if ids["padding"] is None else int(ids["padding"])
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    fields["eos_token_id"] = None if eos is None else int(eos)
    if _field(reader, "clover.model_type") == "clover":  # a Clover checkpoint: its block-diffusion settings
        fields["backbone"] = fields.pop("model_type")
        fields["model_type"] = "clover"
        for key in ("mask_token_id", "block_size", "threshold", "policy", "expert_budget", "block_sizes"):
            v = _field(reader, f"clover.{key}")
            if v is not None:
                fields[key] = _f32(v) if isinstance(v, float) else [int(x) for x in v] if isinstance(v, list) else v
        tpf = _field(reader, "clover.block_tokens_per_forward")  # JSON: {width: tokens per forward}
        if tpf is not None:
            fields["block_tokens_per_forward"] = json.loads(tpf)
        if "mask_token_id" not in fields:
            raise GGUFImportError(f"{path}: a Clover file without 'clover.mask_token_id'; export it again")
    return config_from_dict(fields, source=str(path))


def qwen35moe_state_dict(reader, path: Path, config: CloverConfig, progress: bool = True,
                         extra_readers: tuple = ()) -> dict[str, torch.Tensor]:
    from tqdm import tqdm

    layer, globals_, heads = QWEN35MOE.read_layer(), QWEN35MOE.read_globals(), Heads.of(config)
    expected = expected_shapes(build_model(config, device="meta"))
    state: dict[str, torch.Tensor] = {}
    gate_up: dict[str, dict[str, torch.Tensor]] = {}
    tensors = [(t, p) for r, p in ((reader, path), *extra_readers) for t in r.tensors]
    for t, where in tqdm(tensors, desc="dequantize", unit="tensor", disable=not progress):
        if t.name in globals_:
            name, fn = globals_[t.name]
            w = fn(dequantize(t, where), heads)
        else:
            m = BLOCK.match(t.name)
            leaf = m.group(2) if m else None
            if leaf in SPLIT_EXPERTS:  # fused again: [E, 2I, H], gate rows first
                gate_up.setdefault(f"model.layers.{m.group(1)}.{FUSED_GATE_UP}", {})[SPLIT_EXPERTS[leaf]] = \
                    dequantize(t, where)
                continue
            if leaf not in layer:
                raise GGUFImportError(f"{where}: tensor {t.name!r} is not part of a qwen35moe model this importer knows")
            ours, fn = layer[leaf]
            name = f"model.layers.{m.group(1)}.{ours}"
            raw = dequantize(t, where)
            want = expected.get(name)
            if want is not None and raw.numel() != int(np.prod(want)):
                raise GGUFImportError(f"{where}: tensor {t.name!r} has shape {list(raw.shape)}, which cannot hold "
                                      f"{list(want)} for {name}")
            w = fn(raw, heads)
        state[name] = w
    for name, parts in gate_up.items():
        if set(parts) != {"gate", "up"}:
            raise GGUFImportError(f"{path}: {name} needs both ffn_gate_exps and ffn_up_exps; the file has one")
        state[name] = torch.cat([parts["gate"], parts["up"]], dim=1)
    for name, w in state.items():
        want = expected.get(name)
        if want is None:
            raise GGUFImportError(f"{path}: {name} has no place in a model of this config")
        if tuple(w.shape) != tuple(want):
            raise GGUFImportError(f"{path}: {name} has shape {list(w.shape)} but the metadata gives {list(want)}")
    return _complete(state, expected, config, path)


def _clover_sidecar(reader, path: Path):
    """The reader of the file holding a Clover export's own tensors, when they are not inline."""
    if _field(reader, "clover.tensors") != "sidecar":
        return ()
    name = _field(reader, "clover.tensors_file")
    side = path.with_name(str(name))
    if not side.is_file():
        raise GGUFImportError(f"{path}: its Clover tensors are in {name} (clover.tensors_file), which is not next to "
                              "it; put the two files in one folder")
    return ((_reader(side), side),)


# ----------------------------------------------------------------------------- tokenizer
def write_tokenizer(reader, path: Path, out: Path) -> None:
    """tokenizer.json + tokenizer_config.json (special tokens, chat template) from the metadata."""
    import gguf
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFImportError(f"{path}: tokenizer.ggml.model {kind!r} is not supported (only gpt2, byte-level BPE)")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFImportError(f"{path}: tokenizer.ggml.pre {pre!r} is not supported ({', '.join(PRE_TOKENIZERS)})")
    tokens = list(_require(reader, path, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type") or [gguf.TokenType.NORMAL] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    unused = {i for i, ty in enumerate(types) if ty == gguf.TokenType.UNUSED}  # padding rows of the vocabulary
    vocab = {t: i for t, i in vocab.items() if i not in unused}
    if len(merges) == 1 and merges[0][0] == merges[0][1] and types[vocab.get(merges[0][0], 0)] == gguf.TokenType.CONTROL:
        merges = []  # clover's exporter writes one inert merge (two control tokens) for a tokenizer without any
    tok = RawTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("qwen2", "qwen35"):
        split = pre_tokenizers.Split(Regex(QWEN35_REGEX if pre == "qwen35" else QWEN2_REGEX), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                     use_regex=False)])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    special = [i for i, ty in enumerate(types) if ty == gguf.TokenType.CONTROL]
    user = [i for i, ty in enumerate(types) if ty == gguf.TokenType.USER_DEFINED]
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    if len(tok.get_vocab()) != len(tokens) - len(unused):
        raise GGUFImportError(f"{path}: tokenizer.ggml.tokens holds duplicate tokens; the vocabulary cannot be rebuilt")
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))

    def name(key: str) -> str | None:
        i = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    eos = end_of_generation_ids(reader)
    eos_ids = [eos] if isinstance(eos, int) else (eos or [])
    # the chat's end: the first end-of-generation token the template writes (e.g. <|im_end|>)
    template = _field(reader, "tokenizer.chat_template")
    eos_text = next((tokens[i] for i in eos_ids if template and tokens[i] in template), name("eos"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            str(i): {"content": tokens[i], "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                     "special": i in special}
            for i in sorted(special + user)
        },
        "bos_token": name("bos"),
        "eos_token": eos_text,
        "unk_token": name("unknown"),
        "pad_token": name("padding"),
        "add_bos_token": False,  # the chat template writes the turn markers itself
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, f"{_field(reader, 'general.architecture')}.context_length", 2048) or 2048),
        "gguf_add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
    }
    if template:
        cfg["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------- entry point
def header(path: str | Path):
    """A GGUF file's header read once (gguf's reader over a memory map), for `kept_bits` and `import_gguf`."""
    return _reader(Path(path))


def kept_bits(src: str | Path, *, reader=None) -> int | None:
    """The bits of clover's weight-only quantization (`clover.quant`) that keep a file's layer
    matrices close to what it holds: 4 where every one is Q4_0 or Q4_1 (blocks of 32 inputs; INT4 with
    group 32 has Q4_1's 16-level grid per block, whose ends Q4_1 puts at the block's min and max, with
    the scale and offset rounded to bfloat16), 8 where every one is Q8_0 (INT8: one scale per output
    row where Q8_0 has one per 32 inputs), else None (float32, as `import_gguf` writes)."""
    types = {t.tensor_type.name for t in (reader or _reader(Path(src))).tensors
             if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) == 2}
    if types and types <= {"Q4_0", "Q4_1"}:
        return 4
    return 8 if types == {"Q8_0"} else None


def import_gguf(src: str | Path, dst: str | Path, *, dtype: str = "float32", progress: bool = True,
                reader=None) -> CloverConfig:
    """FILE.gguf -> OUT_DIR (config.json, model.safetensors, tokenizer files). Returns the config. `reader`:
    the file's header already read (`_reader`), else read here."""
    from ..weights import parse_dtype

    src, dst = Path(src), Path(dst)
    reader = reader or _reader(src)
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFImportError(f"{src}: architecture {arch!r} is not supported by import-gguf (supported: "
                              f"{', '.join(ARCHITECTURES)})")
    names = {t.name for t in reader.tensors}
    if arch == "llama":
        config = llama_config(reader, src, names)
        state = llama_state_dict(reader, src, config, progress=progress)
    else:
        config = qwen35moe_config(reader, src, names)
        state = qwen35moe_state_dict(reader, src, config, progress=progress, extra_readers=_clover_sidecar(reader, src))
    torch_dtype = parse_dtype(dtype)
    config.torch_dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[torch_dtype]
    state = {k: v.to(torch_dtype).contiguous() for k, v in state.items()}
    dst.mkdir(parents=True, exist_ok=True)
    write_tokenizer(reader, src, dst)
    config.save(dst)
    save_state_dict(state, dst)
    source = {"gguf": src.name, "name": _field(reader, "general.name"), "file_type": _field(reader, "general.file_type"),
              "types": sorted({t.tensor_type.name for t in reader.tensors})}
    (dst / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id, "imported_from": source}, indent=2) + "\n")
    return config
