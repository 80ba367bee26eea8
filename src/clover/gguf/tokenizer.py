"""The tokenizer's side of a GGUF export: which llama.cpp pre-tokenizer type a tokenizer.json
matches (`detect_pre_tokenizer`), and the vocabulary, merges, special ids and chat template the
file carries (`read_tokenizer`). Importing rebuilds a tokenizer.json from them (`read.write_tokenizer`,
from the same pre-tokenizer regexes)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..config import CloverConfig
from ..tokenizer import MASK_TOKEN
from .names import GGUFExportError

# Our pre-tokenizers, as `tokenizers` serialises them, and the llama.cpp pre-tokenizer type whose
# regexes come closest (`read.write_tokenizer` rebuilds the qwen ones from the same regexes).
# "smollm" = isolate each digit (\p{N}), then the GPT-2 regex: exactly `Digits(individual) + ByteLevel`,
# and no space clean-up on decode.
_PRE_SPLIT_OURS = {"type": "Split", "pattern": {"Regex": "\\n|== "}, "behavior": "MergedWithPrevious", "invert": False}
_PRE_DIGITS = {"type": "Digits", "individual_digits": True}
QWEN35_REGEX = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*"
                "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
QWEN2_REGEX = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
               "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
# what llama.cpp's "smollm" does not reproduce of our clover-tiny pre-tokenizer (see docs/gguf.md)
CLOVER_PRE_TOKENIZER_GAPS = (
    "`== ` followed by a letter, bracket or quote: ours keeps the space alone (`==`, ` `, `[`), llama.cpp joins it "
    "to what follows (`==`, ` [`); prompts that end in `== ` tokenize the same",
    "spaces before a newline that is followed by text: ours keeps `  \\n` one piece, llama.cpp splits `  `, `\\n`; "
    "no effect with the bundled vocabulary (none of its merges joins a newline to anything)",
)


def _is_byte_level(p: dict, use_regex: bool) -> bool:
    return p.get("type") == "ByteLevel" and bool(p.get("use_regex", True)) == use_regex and not p.get("add_prefix_space", False)


def detect_pre_tokenizer(tokenizer_json: dict) -> tuple[str, bool]:
    """(llama.cpp pre-tokenizer type, exact) for a tokenizer.json, or GGUFExportError."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    merges = tokenizer_json.get("model", {}).get("merges") or []
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if not merges and all(s.get("type") in ("ByteLevel", "Split", "Digits") for s in steps):
        return "gpt-2", True  # no merges: every byte is its own token, however the text is split
    if len(steps) == 1 and _is_byte_level(steps[0], True):
        return "gpt-2", True
    if len(steps) == 2 and steps[0] == _PRE_DIGITS and _is_byte_level(steps[1], True):
        return "smollm", True
    if len(steps) == 3 and steps[0] == _PRE_SPLIT_OURS and steps[1] == _PRE_DIGITS and _is_byte_level(steps[2], True):
        return "smollm", False
    if len(steps) == 2 and steps[0].get("type") == "Split" and _is_byte_level(steps[1], False):
        regex = steps[0].get("pattern", {}).get("Regex")
        if regex == QWEN35_REGEX:
            return "qwen35", True
        if regex == QWEN2_REGEX:
            return "qwen2", True
    raise GGUFExportError(
        "the tokenizer's pre-tokenizer matches no llama.cpp pre-tokenizer type this exporter knows "
        f"({json.dumps(pre)[:200]}); pass pre_tokenizer= / --pre-tokenizer NAME to pick one (tokenization may then differ)")


@dataclass
class TokenizerMetadata:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str
    pre_exact: bool
    eos_id: int | None
    pad_id: int | None
    bos_id: int | None
    mask_id: int | None
    chat_template: str | None
    placeholder_merge: bool = False


def read_tokenizer(src: Path, config: CloverConfig, *, pre_tokenizer: str | None = None) -> TokenizerMetadata:
    import gguf

    path = src / "tokenizer.json"
    if not path.exists():
        raise GGUFExportError(f"{src}: no tokenizer.json; GGUF export needs the fast (byte-level BPE) tokenizer")
    tj = json.loads(path.read_text())
    model = tj.get("model", {})
    if model.get("type") != "BPE":
        raise GGUFExportError(f"{path}: tokenizer model {model.get('type')!r} is not supported; only byte-level BPE (GPT-2 style)")
    if model.get("byte_fallback") or tj.get("normalizer") is not None:
        raise GGUFExportError(f"{path}: byte_fallback / a normalizer are not supported; only GPT-2-style byte-level BPE")
    decoder = tj.get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        raise GGUFExportError(f"{path}: decoder {decoder.get('type')!r} is not ByteLevel; only GPT-2-style byte-level BPE")
    if pre_tokenizer is None:
        pre, exact = detect_pre_tokenizer(tj)
    else:
        pre, exact = pre_tokenizer, False
    id_to_token: dict[int, str] = {i: t for t, i in model.get("vocab", {}).items()}
    added = {a["id"]: a for a in tj.get("added_tokens", [])}
    for i, a in added.items():
        id_to_token[i] = a["content"]
    n_tok = max(id_to_token) + 1 if id_to_token else 0
    if n_tok > config.vocab_size:
        raise GGUFExportError(f"{path}: the tokenizer has ids up to {n_tok - 1} but the model's vocab_size is {config.vocab_size}")
    T = gguf.TokenType
    tokens, types = [], []
    for i in range(config.vocab_size):
        if i not in id_to_token:
            tokens.append(f"[PAD{i}]")
            types.append(T.UNUSED)
        elif i in added:
            tokens.append(id_to_token[i])
            types.append(T.CONTROL if added[i].get("special", False) else T.USER_DEFINED)
        else:
            tokens.append(id_to_token[i])
            types.append(T.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    placeholder = False
    if not merges:
        # llama.cpp insists on a merges array and gguf cannot write an empty one: one merge of two
        # multi-character special tokens, which never occur inside a pre-tokenized piece, is inert
        specials = [a["content"] for a in added.values() if " " not in a["content"] and len(a["content"]) > 1]
        if not specials:
            raise GGUFExportError(f"{path}: a tokenizer without merges needs a special token for the placeholder merge")
        merges = [f"{specials[0]} {specials[0]}"]
        placeholder = True
    template = None
    tc_path = src / "tokenizer_config.json"
    if tc_path.exists():
        template = json.loads(tc_path.read_text()).get("chat_template")
    if template is None and (src / "chat_template.jinja").exists():
        template = (src / "chat_template.jinja").read_text()
    if isinstance(template, list):  # [{"name": ..., "template": ...}]: keep the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    mask = config.mask_token_id
    if mask is None:
        mask = next((i for i, a in added.items() if a["content"] == MASK_TOKEN), None)
    eos = config.eos_token_ids[0] if config.eos_token_ids else None
    return TokenizerMetadata(tokens, [int(t) for t in types], merges, pre, exact, eos, config.pad_token_id,
                             config.bos_token_id, mask, template, placeholder)
