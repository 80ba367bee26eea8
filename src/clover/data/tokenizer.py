"""Byte-level BPE tokenizer for clover, trained offline on the stdlib + tasks.

Pipeline (all exact and reversible):

* no normaliser (bytes are kept as they are);
* pre-tokeniser, in order:
  1. split after every ``"\\n"`` and after every ``"== "`` -- so a line, and
     the prompt of a task line, always ends on a token boundary.  A prompt
     (``"assert ... == "``, or a function header ending in ``":\\n"``) then
     tokenises exactly as it does inside the full training text;
  2. every digit is its own token;
  3. byte-level mapping with the usual word/space regex, no prefix space;
* byte-level decoder, no post-processor (nothing is added when encoding).

Special tokens get the first ids, in :data:`SPECIAL_TOKENS` order.

CLI: ``clover train tokenizer OUT_DIR [--vocab-size N]``.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import time
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from . import corpus, tasks

from ..tokenizer import (  # noqa: F401  (re-exported: the special tokens have one home)
    CHAT_TEMPLATE,
    EOS_TOKEN,
    IM_END,
    IM_START,
    MASK_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    write_tokenizer_config,
)

DEFAULT_VOCAB_SIZE = 4096
DEFAULT_MAX_CHARS = 24_000_000
DEFAULT_TASK_LINES = 40_000

def build_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\n|== "), behavior="merged_with_previous"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def new_tokenizer() -> Tokenizer:
    """An untrained tokenizer with clover's pipeline."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = build_pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    return tok


def training_texts(
    max_chars: int = DEFAULT_MAX_CHARS,
    seed: int = 0,
    n_task_lines: int = DEFAULT_TASK_LINES,
    verbose: bool = False,
) -> list[str]:
    """Deterministic training sample: shuffled train-split stdlib files (up to
    ``max_chars`` characters in total) followed by task lines (grouped 16 per
    text) from the training task stream."""
    files = corpus.stdlib_files("train")
    order = list(range(len(files)))
    random.Random(seed).shuffle(order)
    texts: list[str] = []
    budget = max_chars
    for i in order:
        if budget <= 0:
            break
        text = corpus.read_text(files[i])
        if not text:
            continue
        text = text[:budget]
        texts.append(text)
        budget -= len(text)
    if verbose:
        print(
            f"[tokenizer] {len(texts)} stdlib files, {max_chars - max(budget, 0):,} chars",
            file=sys.stderr,
        )
    if n_task_lines > 0:
        lines = [tasks.task_line(t) for t in tasks.train_tasks(n_task_lines, seed=tasks.TRAIN_SEED + seed)]
        for j in range(0, len(lines), 16):
            texts.append("\n".join(lines[j : j + 16]) + "\n")
        if verbose:
            print(f"[tokenizer] {len(lines)} task lines", file=sys.stderr)
    return texts


def train_tokenizer_object(
    texts: list[str], vocab_size: int = DEFAULT_VOCAB_SIZE, show_progress: bool = False
) -> Tokenizer:
    """Train a BPE tokenizer with clover's pipeline on ``texts``."""
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: str | Path) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and
    ``special_tokens_map.json`` into ``out_dir`` (loadable by
    ``transformers.AutoTokenizer.from_pretrained``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"), pretty=True)
    write_tokenizer_config(out, tok)
    return out


def train_tokenizer(
    out_dir: str | Path,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
    max_chars: int = DEFAULT_MAX_CHARS,
    n_task_lines: int = DEFAULT_TASK_LINES,
    verbose: bool = True,
) -> Tokenizer:
    """Train clover's tokenizer and save it into ``out_dir``.

    Deterministic given the arguments (and the interpreter's stdlib).  With
    ``verbose`` progress goes to stderr.  Returns the ``tokenizers.Tokenizer``.
    """
    t0 = time.time()
    texts = training_texts(max_chars=max_chars, seed=seed, n_task_lines=n_task_lines, verbose=verbose)
    if verbose:
        print(f"[tokenizer] training BPE, vocab {vocab_size} ...", file=sys.stderr)
    tok = train_tokenizer_object(texts, vocab_size=vocab_size, show_progress=verbose)
    save_tokenizer(tok, out_dir)
    if verbose:
        print(
            f"[tokenizer] vocab {tok.get_vocab_size()} saved to {out_dir} in {time.time() - t0:.1f}s",
            file=sys.stderr,
        )
    return tok


def load_tokenizer(src: "str | Path | Tokenizer | object") -> Tokenizer:
    """A ``tokenizers.Tokenizer`` from a directory / tokenizer.json path, a
    ``Tokenizer``, or a transformers fast tokenizer."""
    if isinstance(src, Tokenizer):
        return src
    backend = getattr(src, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        return backend
    p = Path(src)  # type: ignore[arg-type]
    if p.is_dir():
        p = p / "tokenizer.json"
    return Tokenizer.from_file(str(p))


def tokenizer_hash(tok: Tokenizer) -> str:
    """Stable sha1 of the tokenizer's serialised form."""
    return hashlib.sha1(tok.to_str().encode("utf-8")).hexdigest()


def special_token_ids(tok: Tokenizer) -> dict[str, int]:
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}

