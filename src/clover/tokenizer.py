"""The tokenizer a model directory carries (`tokenizer.json` + `tokenizer_config.json`), behind the
small interface the engine needs: `tokenizers` for encoding and decoding, transformers' fast
tokenizer (chat templates) loaded only when asked for."""

from __future__ import annotations

import json
import re
from pathlib import Path

# the files of a model directory that make up its tokenizer (nothing else is copied with it)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json")


def copy_tokenizer_files(src: str | Path, dst: str | Path, *, overwrite: bool = True) -> list[str]:
    """Copy the `TOKENIZER_FILES` that `src` has into `dst` (never its weights or config.json, so a
    model directory can serve as the tokenizer source); returns the names copied."""
    import shutil

    src, dst = Path(src), Path(dst)
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and (overwrite or not (dst / name).exists()):
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


EOS_TOKEN, PAD_TOKEN, MASK_TOKEN = "<|endoftext|>", "<|pad|>", "<|mask|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, MASK_TOKEN, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


class ChatTemplateError(ValueError):
    """The chat template cannot render these messages (or the tokenizer has none)."""


def _token_name(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class Tokenizer:
    """Encoding and decoding go through the `tokenizers` library directly (what transformers' fast
    tokenizer does underneath, with `add_special_tokens=False` and no clean-up of spaces); the
    transformers tokenizer (`.hf`: chat templates, the server's vocabulary) is loaded on first use,
    so a plain generation never imports transformers."""

    def __init__(self, hf_tokenizer=None, *, eos_token_id: int | None = None, mask_token_id: int | None = None,
                 raw=None, directory: str | Path | None = None, names: dict | None = None) -> None:
        self._hf = hf_tokenizer
        self._dir = Path(directory) if directory is not None else None
        if hf_tokenizer is not None:
            raw = hf_tokenizer.backend_tokenizer
            names = {k: getattr(hf_tokenizer, k, None) for k in ("eos_token", "pad_token", "mask_token")}
        self.raw = raw
        names = names or {}

        def tid(key):
            name = names.get(key)
            return raw.token_to_id(name) if name else None

        self.eos_token_id = eos_token_id if eos_token_id is not None else tid("eos_token")
        mask = mask_token_id
        if mask is None:
            mask = tid("mask_token")
        self.mask_token_id = mask
        pad = tid("pad_token")
        self.pad_token_id = pad if pad is not None else self.eos_token_id

    @property
    def hf(self):
        """transformers' fast tokenizer of the same files (imported and loaded on first use)."""
        if self._hf is None:
            from transformers import PreTrainedTokenizerFast

            self._hf = PreTrainedTokenizerFast.from_pretrained(str(self._dir), local_files_only=True)
        return self._hf

    @classmethod
    def from_dir(cls, directory: str | Path, *, eos_token_id=None, mask_token_id=None) -> "Tokenizer":
        """The fast tokenizer of a model directory: `tokenizer.json` (+ `tokenizer_config.json`).
        A slow tokenizer (tokenizer.model, vocab.json + merges.txt) is never converted at load."""
        from tokenizers import Tokenizer as RawTokenizer

        directory = Path(directory)
        tok_file = directory / "tokenizer.json"
        if not tok_file.exists():
            slow = [n for n in ("tokenizer.model", "vocab.json", "merges.txt") if (directory / n).exists()]
            raise FileNotFoundError(
                f"{directory}: no tokenizer.json in the model directory"
                + (f" (it has {', '.join(slow)}, a slow tokenizer, which clover does not convert)" if slow else "")
                + "; copy tokenizer.json from the model's original repository (it sits next to config.json), "
                "or write one with transformers: AutoTokenizer.from_pretrained(SRC).save_pretrained(DIR)"
            )
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            path = directory / name
            if path.exists() and not path.is_file():  # a FIFO would block the read forever
                raise ValueError(f"{path}: not a regular file; {name} must be a plain JSON file")
        names: dict = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # small: check them here, to name them
            path = directory / name
            if path.exists():
                try:
                    data = json.loads(path.read_text(encoding="utf-8"))
                except (ValueError, UnicodeDecodeError) as e:
                    raise ValueError(f"{path}: not valid JSON ({e})") from None
                if isinstance(data, dict):  # tokenizer_config.json wins, as in transformers
                    names.update({k: _token_name(data[k]) for k in ("eos_token", "pad_token", "mask_token") if k in data})
        try:
            raw = RawTokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers reports a corrupt file as a bare Exception
            raise ValueError(
                f"{tok_file}: cannot load the tokenizer ({type(e).__name__}: {e}); the file is corrupt or not a "
                "Hugging Face tokenizers file"
            ) from None
        return cls(raw=raw, directory=directory, names=names, eos_token_id=eos_token_id, mask_token_id=mask_token_id)

    @property
    def vocab_size(self) -> int:
        return self.raw.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.raw.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        return self.raw.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def is_chat(self) -> bool:
        """Whether this is a chat (instruct) model's tokenizer: it carries a chat template of its own.
        `CHAT_TEMPLATE`, which `write_tokenizer_config` gives every tokenizer clover writes (the
        bundled model's, `clover tiny`'s), does not count: those models were trained on plain text."""
        template = self.chat_template
        return bool(template) and template != CHAT_TEMPLATE

    @property
    def chat_template(self) -> str | None:
        """The chat template, read off the directory's files (without loading transformers) when
        the tokenizer came from one."""
        if self._hf is not None or self._dir is None:
            return getattr(self.hf, "chat_template", None) if self._hf is not None else None
        jinja = self._dir / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        for name in ("chat_template.json", "tokenizer_config.json"):
            path = self._dir / name
            try:
                template = json.loads(path.read_text(encoding="utf-8")).get("chat_template") if path.is_file() else None
            except (ValueError, UnicodeDecodeError, AttributeError):
                template = None
            if template:
                return template if isinstance(template, str) else None
        return None

    def end_of_turn_id(self) -> int | None:
        """The id of `<|im_end|>`, the token that ends a chat turn, when the vocabulary has it."""
        return self.raw.token_to_id(IM_END)

    def supports_tools(self) -> bool:
        """Whether the chat template renders `tools` and tool calls itself."""
        return "tools" in (self.chat_template or "")

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> list[int]:
        """The chat prompt's token ids. Control tokens (the special tokens) written in message
        content are encoded as text: only the template itself writes control tokens, so user text
        cannot open or close turns (transformers' `sanitize_control_tokens=True`; vLLM does the same).
        Raises `ChatTemplateError` (a ValueError) when there is no template or it fails to render."""
        if not getattr(self.hf, "chat_template", None):
            raise ChatTemplateError("this model's tokenizer has no chat template; use a plain prompt instead")
        try:
            if self._sanitize_supported():
                out = self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                                  sanitize_control_tokens=True, **({"tools": tools} if tools else {}))
            else:
                out = self._encode_rendered(messages, add_generation_prompt, tools)
        except ChatTemplateError:
            raise
        except Exception as e:  # noqa: BLE001 - jinja2.TemplateError, raise_exception(), a TypeError in the template
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    def _sanitize_supported(self) -> bool:
        if not hasattr(self, "_sanitize"):
            import inspect

            self._sanitize = "sanitize_control_tokens" in inspect.signature(self.hf.apply_chat_template).parameters
        return self._sanitize

    def _encode_rendered(self, messages: list[dict], add_generation_prompt: bool, tools=None) -> list[int]:
        """For transformers without `sanitize_control_tokens`: control tokens in the messages are
        swapped for private-use placeholders before rendering; the rendered text is split at the
        control tokens the template wrote, and each piece between them is encoded with special
        tokens read as text, the placeholders turned back into the text they stand for."""
        specials = sorted({t.content for t in self.hf.added_tokens_decoder.values() if t.special}, key=len, reverse=True)
        extra = {"tools": tools} if tools else {}
        if not specials:
            return self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True, **extra)
        used = "".join(str(v) for m in messages for v in m.values())
        lead = next(chr(c) for c in range(0xE000, 0xF8FF) if chr(c) not in used)
        marks = {s: f"{lead}{chr(0xF000 + i)}" for i, s in enumerate(specials)}
        pattern = re.compile("|".join(map(re.escape, specials)))

        def mark(v):
            return pattern.sub(lambda m: marks[m.group(0)], v) if isinstance(v, str) else v

        text = self.hf.apply_chat_template([{k: mark(v) for k, v in m.items()} for m in messages],
                                           add_generation_prompt=add_generation_prompt, tokenize=False, **extra)
        back = {v: k for k, v in marks.items()}
        ids: list[int] = []
        pos = 0
        for m in list(pattern.finditer(text)) + [None]:
            piece = text[pos : m.start() if m else len(text)]
            if piece:
                for k, v in back.items():
                    piece = piece.replace(k, v)
                ids += self.hf.encode(piece, add_special_tokens=False, split_special_tokens=True)
            if m:
                ids.append(self.hf.convert_tokens_to_ids(m.group(0)))
                pos = m.end()
        return ids

    def __repr__(self) -> str:
        return f"Tokenizer(vocab={self.vocab_size}, eos={self.eos_token_id}, mask={self.mask_token_id})"


def write_byte_tokenizer(directory: str | Path, specials: tuple[str, ...] = SPECIAL_TOKENS) -> dict[str, int]:
    """A byte-level tokenizer with no merges (256 byte tokens + the special tokens): any text
    round-trips. Used for tiny random models. Returns the special token ids."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = RawTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))
    tok.save(str(directory / "tokenizer.json"))
    write_tokenizer_config(directory, tok)
    return {t: tok.token_to_id(t) for t in specials}


def write_tokenizer_config(directory: str | Path, tok) -> None:
    """tokenizer_config.json + special_tokens_map.json for a raw `tokenizers.Tokenizer` holding our
    special tokens, so transformers loads the directory as a fast tokenizer with the chat template."""
    present = [t for t in SPECIAL_TOKENS if tok.token_to_id(t) is not None]
    added = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": True}
        for t in present
    }
    named = {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "mask_token": MASK_TOKEN}
    named = {k: v for k, v in named.items() if v in present}
    extra = [t for t in (IM_START, IM_END) if t in present]
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "unk_token": None,
        **named,
        "additional_special_tokens": extra,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "padding_side": "right",
        "chat_template": CHAT_TEMPLATE,
    }
    directory = Path(directory)
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    smap = {**named, "additional_special_tokens": extra}
    (directory / "special_tokens_map.json").write_text(json.dumps(smap, indent=2) + "\n")
