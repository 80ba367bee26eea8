"""The public entry points: `clover.load(...) -> LLM`, `LLM.generate`, `LLM.stream`, `LLM.chat`,
`LLM.chat_stream`.

Loading helpers every front end shares (the CLI, the server, bench, eval): `model_path(given)` (a
directory, or a model name resolved to its directory), `default_model_path()` (`$CLOVER_MODEL`, else
the bundled model), `check_device(device)` (a device this machine has),
`load(path, dtype=, device=, check_finite=)` and `LLM.default_mode` (the mode used when none is
named)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal, Sequence

import torch

from .checkpoint import OWN_DRAFTER, load_model, parse_dtype
from .models import read_config
from .config import CloverConfig
from .decoding.base import DecodeEvent, GenerationStats, RowState
from .decoding.modes import EngineSpec, Mode, default_mode, get_mode, resolve_params
from .decoding.sampling import SamplingParams
from .tokenizer import Tokenizer

BUNDLED_MODEL = Path(__file__).parent / "assets" / "clover-tiny"
BUNDLED_DRAFTER = Path(__file__).parent / "assets" / "clover-tiny-dflash"  # the bundled model's DFlash drafter


def model_path(given: str | os.PathLike, *, device: str | None = None) -> Path:
    """What a user's model argument names: the directory itself when it exists; for a GGUF file, the
    directory it was imported into (`named.imported_gguf`: on first use, with a progress bar); else the directory
    of the named model (a name such as clover-smol, pulled into the user cache; FileNotFoundError
    with the `clover pull` command when it is not there yet); else, for a Hugging Face repo id
    (`ORG/NAME`), its snapshot in the hub cache (`hub.resolve`: downloaded after the fit check for
    `device` when online and not cached; offline, FileNotFoundError naming `clover pull`); else the
    path as given (for the caller to report). A local path wins over a repo id of the same spelling."""
    path = Path(given)
    if path.suffix.lower() == ".gguf" and path.is_file():  # imported into the user cache once
        from .named import imported_gguf

        return imported_gguf(path)
    if not path.exists():
        from .named import resolve_named

        named = resolve_named(str(path))
        if named is not None:
            return named
        from .hub import is_repo_id, resolve

        if is_repo_id(str(given)):
            return resolve(str(given), device=device)
    return path


def default_model_path() -> Path:
    env = os.environ.get("CLOVER_MODEL")
    if env:
        return Path(env)
    if (BUNDLED_MODEL / "config.json").exists():
        return BUNDLED_MODEL
    raise FileNotFoundError(
        f"no model given and the bundled model is missing at {BUNDLED_MODEL}; pass a model directory "
        "(or build a tiny random one with `clover tiny DIR`)"
    )


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats
    prompt_token_ids: list[int] = field(default_factory=list)
    decode_steps: list[int] = field(default_factory=list)  # per token: the denoise step that decoded it
    forced_tokens: list[int] = field(default_factory=list)  # token indices committed below the threshold (diffusion)
    stop_token: int | None = None  # the EOS / stop token id that ended the output (not in token_ids)

    def as_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.as_dict(),
        }


@dataclass
class StreamEvent:
    """What a stream reports, for `LLM.stream` and the server alike (`RowStream` makes them). kind:
    - "block": `text` the newly committed text a stream may show (never a partial UTF-8 character
      nor a tail that could start a stop string, so what is shown is always a prefix of the final
      text); `token_ids` / `steps` / `forced` the tokens committed, the denoise step of each and
      whether a forced step committed it;
    - "provisional": the current block after a denoise step (`token_ids[i]` None while masked,
      `steps[i]` 0 until decoded);
    - "done": the row is over: `generation`, and `text` what of it was not shown yet;
    - "error": the row could not be decoded (the server: admission or a forward failed); `text` why.
    `index`: the row (a server request's choice; 0 for `LLM.stream`)."""

    kind: Literal["block", "provisional", "done", "error"]
    text: str = ""
    token_ids: list = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    forced: list[bool] = field(default_factory=list)
    block: int = 0
    step: int = 0
    generation: Generation | None = None
    index: int = 0


class RowStream:
    """One row's stream: turns its engine's `DecodeEvent`s into `StreamEvent`s, emitting only what
    `RowState.stream_text` allows (the one rule for `LLM.stream` and the server's streams)."""

    def __init__(self, llm: "LLM", row: RowState, index: int = 0) -> None:
        self.llm, self.row, self.index = llm, row, index
        self.shown = 0  # characters of the text reported so far

    def _delta(self) -> str:
        text = self.row.stream_text()
        if len(text) <= self.shown:
            return ""
        delta, self.shown = text[self.shown:], len(text)
        return delta

    def event(self, ev: DecodeEvent) -> StreamEvent:
        if ev.kind == "provisional":
            return StreamEvent("provisional", token_ids=ev.token_ids, steps=ev.steps, block=ev.block, step=ev.step,
                               index=self.index)
        if ev.kind == "commit":
            start, forced = len(self.row.tokens) - len(ev.token_ids), set(self.row.forced)
            return StreamEvent("block", text=self._delta(), token_ids=list(ev.token_ids), steps=list(ev.steps),
                               forced=[start + j in forced for j in range(len(ev.token_ids))], block=ev.block,
                               step=ev.step, index=self.index)
        return self.done()

    def done(self) -> StreamEvent:
        """The row is over (finished or cancelled): its Generation and the text not shown yet."""
        return StreamEvent("done", text=self._delta(), generation=self.llm.result(self.row), index=self.index)


def check_device(device: str | torch.device | None) -> None:
    """ValueError ("device: why") unless `device` is None or a torch device this machine has."""
    if device is None:
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: not a torch device: {device!r} (try cpu or cuda)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device} is not available: CUDA is not available on this machine")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device: {device} is not available: MPS is not available on this machine")


class LLM:
    def __init__(self, model, tokenizer: Tokenizer, path: Path | None = None, drafter=None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.path = path
        self.config = model.config
        self._eos_ids = frozenset(self.config.eos_token_ids) | (
            {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        self.drafter = drafter  # a DFlash drafter for mode "dflash" (`clover.models.dflash`), or None

    # ---------------------------------------------------------------- helpers
    @property
    def context_length(self) -> int:
        return self.config.max_position_embeddings

    @property
    def default_mode(self) -> str:
        """The name of the mode used when none is named: the one the checkpoint states (config
        `default_mode`, `decoding.modes.default_mode`; ar when it needs a drafter that is not loaded),
        else diffusion for a Clover checkpoint, ar for a plain AR one."""
        return self.mode().name

    def mode(self, name: str | Mode | None = None) -> Mode:
        """The `Mode` of that name; None: the model's default (as the CLI and the server use)."""
        if name is not None:
            return get_mode(name)
        m = default_mode(self.config)
        return m if self.mode_available(m) else get_mode("ar")

    @property
    def is_chat(self) -> bool:
        """A chat (instruct) model: its tokenizer has a chat template of its own (`Tokenizer.is_chat`).
        `chat` is the way to prompt it; `generate` sends the text as it is."""
        return self.tokenizer.is_chat

    def mode_available(self, mode: str | Mode) -> bool:
        """Whether `mode` can run here: a mask token for the modes that decode with it (a Clover
        checkpoint), a loaded drafter for those that need one (dflash), the canvas mode for a
        whole-sequence model and no other (`Mode.available`)."""
        m = self.mode(mode)
        return (m.available(self.config) and (not m.needs_mask or self.config.mask_token_id is not None)
                and (not m.needs_drafter or self.drafter is not None))

    def params(self, mode: str | Mode | None, kwargs: dict) -> SamplingParams:
        """The generation options for `mode`, checked (ValueError "option: why" / TypeError for an
        unknown option), with the model's defaults filled in."""
        m = self.mode(mode)
        why = m.refusal(self.config)
        if why is not None:
            raise ValueError(why)
        params = resolve_params(m, kwargs, self.config)
        if m.needs_drafter and self.drafter is None:
            raise ValueError(f"mode: {m.name!r} needs a DFlash drafter; load one with clover.load(model, drafter=DIR) "
                             "(CLI and server: --drafter DIR)")
        return params

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary (size {self.config.vocab_size})")
        else:
            raise TypeError("prompt must be a string or a list of token ids")
        if not ids:
            raise ValueError("prompt: empty; give at least one token")
        return ids

    def plan(self, mode: Mode, params: SamplingParams, provisional: bool = False) -> EngineSpec:
        """The plan rows of `mode` with options `params` decode with (`Mode.plan`, resolved against this
        model and its drafter): what the context check, the engine's cache and the batching key read."""
        return mode.plan(params, provisional, config=self.config, drafter=self.drafter)

    def _reserve(self, params: SamplingParams, plan: EngineSpec | Mode) -> int:
        return (self.plan(plan, params) if isinstance(plan, Mode) else plan).reserve

    def check_length(self, prompt_len: int, params: SamplingParams, plan: EngineSpec | Mode) -> None:
        """ValueError (naming `prompt`) when the prompt plus what `plan` generates does not fit (a
        `Mode`: planned here)."""
        extra = self._reserve(params, plan)
        total = prompt_len + params.max_new_tokens + extra
        if prompt_len >= self.context_length or total > self.context_length:
            raise ValueError(
                f"prompt: {prompt_len} tokens + max_new_tokens {params.max_new_tokens}"
                + (f" + one block ({extra})" if extra else "")
                + f" exceeds the context length {self.context_length}; shorten the prompt or lower max_new_tokens"
            )

    def room(self, prompt_len: int, params: SamplingParams, plan: EngineSpec | Mode) -> int:
        """The most tokens `plan` can generate after a prompt of `prompt_len` tokens (a `Mode`: planned
        here)."""
        return max(0, self.context_length - prompt_len - self._reserve(params, plan))

    def eos_ids(self) -> set[int]:
        """The tokens that end a row: the config's EOS ids and the tokenizer's (every front end's set)."""
        return set(self._eos_ids)

    def compile_grammar(self, grammar, params: SamplingParams, *, eos_ids=None, mode: Mode | str | None = None):
        """`grammar` (a `clover.grammar.GrammarSpec`, a dict {kind: source}, or None) compiled for
        this model's tokenizer; the EOS and stop tokens end the output once it is complete.
        GrammarError (a ValueError "grammar: why") when it cannot be used."""
        if grammar is None:
            return None
        from .grammar import GrammarError, GrammarSpec, compile_grammar

        if mode is not None and not self.mode(mode).grammar:
            raise GrammarError(f"mode: {self.mode(mode).name} does not support structured output; "
                               "use ar, diffusion or speculative")

        ends = set(self.eos_ids() if eos_ids is None else eos_ids) | set(params.stop_token_ids)
        if params.ignore_eos:
            ends = set(params.stop_token_ids)
        return compile_grammar(GrammarSpec.coerce(grammar), self.tokenizer, vocab_size=self.config.vocab_size,
                               eos_ids=ends)

    def row(self, prompt: list[int], params: SamplingParams, grammar=None) -> RowState:
        """A row to decode: `prompt` with options `params`, ending at this model's EOS set;
        `grammar` (compiled, `compile_grammar`) constrains it."""
        row = RowState(list(prompt), params, self.eos_ids(), decode=self.tokenizer.decode)
        row.constraint = grammar.matcher() if grammar is not None else None
        return row

    def _grammar_kwargs(self, kwargs: dict):
        """Pops `response_format=` (OpenAI's shape) and `grammar=` from the generation options."""
        rf, grammar = kwargs.pop("response_format", None), kwargs.pop("grammar", None)
        if rf is None:
            return grammar  # (clover.grammar is imported only where a grammar is used)
        from .grammar import GrammarError, GrammarSpec

        if grammar is not None:
            raise GrammarError("grammar: give response_format or grammar, not both")
        return GrammarSpec.from_response_format(rf)

    def engine(self, spec: EngineSpec):
        """A fresh batch engine for rows of `spec` (the plan, `LLM.plan`; rows join it with `add`,
        `run()` yields events). A mode that needs a drafter gets this LLM's."""
        return spec.make_engine(self.model, mask_id=self.config.mask_token_id, pad_id=self.tokenizer.pad_token_id or 0,
                                drafter=self.drafter)

    def _events(self, rows: list[RowState], spec: EngineSpec) -> Iterator[DecodeEvent]:
        engine = self.engine(spec)
        for r in rows:
            yield from engine.add(r)
        yield from engine.run()

    def result(self, row: RowState) -> Generation:
        """The finished (or cancelled) row as a `Generation`."""
        return Generation(
            text=row.text(),
            token_ids=list(row.tokens),
            finish_reason=row.finish_reason or "length",
            stats=GenerationStats.from_row(row),
            prompt_token_ids=list(row.prompt),
            decode_steps=list(row.steps),
            forced_tokens=list(row.forced),
            stop_token=row.stop_token,
        )

    # ------------------------------------------------------------------- API
    def generate(self, prompt, *, mode: str | Mode | None = None, **kwargs) -> Generation | list[Generation]:
        """prompt: str | list[int] -> Generation; a list of prompts (list[str] or list[list[int]])
        -> list[Generation], decoded together as one batch. `mode` None: the model's default, as
        `clover generate` and `clover serve` use (`LLM.default_mode`). `response_format=` (OpenAI's:
        {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}) or
        `grammar=` (a `clover.grammar.GrammarSpec`, or {"regex"|"lark"|"gbnf"|"json_schema": src})
        constrains the output in every mode (docs/structured-output.md)."""
        batched = isinstance(prompt, (list, tuple)) and prompt and not all(isinstance(t, int) for t in prompt)
        prompts = list(prompt) if batched else [prompt]
        grammar = self._grammar_kwargs(kwargs)
        m = self.mode(mode)
        params = resolve_params(m, kwargs, self.config)
        plan = self.plan(m, params)
        ids = [self.encode_prompt(p) for p in prompts]
        for p in ids:
            self.check_length(len(p), params, plan)
        compiled = self.compile_grammar(grammar, params, mode=m)
        rows = [self.row(p, params, compiled) for p in ids]
        for _ in self._events(rows, plan):
            pass
        results = [self.result(r) for r in rows]
        if any(isinstance(p, str) and not r.token_ids for p, r in zip(prompts, results)) and self.is_chat:
            import warnings

            warnings.warn(f"{self.path}: a chat model ended a plain-text prompt at once (0 tokens); "
                          "llm.chat([{'role': 'user', 'content': ...}]) applies its chat template", stacklevel=2)
        return results if batched else results[0]

    def stream(self, prompt, *, mode: str | Mode | None = None, provisional: bool = False, **kwargs) -> Iterator[StreamEvent]:
        """Yield a "block" event per committed block (AR: per token) with the text delta, optional
        "provisional" events after each denoise step, and a final "done" event. `mode` None: the
        model's default; `response_format=` / `grammar=` as in `generate`."""
        grammar = self._grammar_kwargs(kwargs)
        m = self.mode(mode)
        params = resolve_params(m, kwargs, self.config)
        plan = self.plan(m, params, provisional)
        ids = self.encode_prompt(prompt)
        self.check_length(len(ids), params, plan)
        row = self.row(ids, params, self.compile_grammar(grammar, params, mode=m))
        stream = RowStream(self, row)
        held: StreamEvent | None = None  # tokens committed while the text could not advance yet
        for ev in self._events([row], plan):
            if ev.kind == "finish":
                continue  # `done` below
            out = stream.event(ev)
            if out.kind == "block":
                if held is not None:  # carried into the next block that shows text
                    out.token_ids, out.steps = held.token_ids + out.token_ids, held.steps + out.steps
                    out.forced = held.forced + out.forced
                held = None if out.text else out
                if held is not None:
                    continue
            yield out
        done = stream.done()
        if done.text or held is not None:
            yield StreamEvent("block", text=done.text, token_ids=held.token_ids if held else [],
                              steps=held.steps if held else [], forced=held.forced if held else [], block=-1)
        done.text = ""
        yield done

    def chat_prompt(self, messages: list[dict], *, tools: list[dict] | None = None) -> list[int]:
        """The token ids of `messages` (OpenAI's shape: [{"role": "user", "content": "..."}, ...])
        rendered by the chat template, ending with the assistant's turn opened. ValueError ("messages:
        why") for messages that are not that shape or a tokenizer without a template."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages: give a non-empty list of {'role': ..., 'content': ...} dicts")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}]: expected {{'role': str, 'content': str}}, got {m!r}"[:200])
        try:
            return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tools=tools)
        except ValueError as e:
            raise ValueError(f"messages: {e}") from None

    def chat_options(self, kwargs: dict) -> dict:
        """Generation options for a chat turn: the user's, plus the end of the turn (`<|im_end|>`,
        as a stop token when the vocabulary has it and as a stop string) ending the reply."""
        from .tokenizer import IM_END

        out = dict(kwargs)
        out["stop"] = [IM_END] + [s for s in (out.get("stop") or []) if s != IM_END]
        end = self.tokenizer.end_of_turn_id()
        if end is not None:
            out["stop_token_ids"] = [end] + [t for t in (out.get("stop_token_ids") or []) if t != end]
        return out

    def chat(self, messages: list[dict], *, mode: str | Mode | None = None, **kwargs) -> Generation:
        """The assistant's reply to `messages` (a chat model's way in: the chat template applied, the
        reply ending at the end of its turn). Options as in `generate`. `chat_stream` streams it."""
        return self.generate(self.chat_prompt(messages), mode=mode, **self.chat_options(kwargs))

    def chat_stream(self, messages: list[dict], *, mode: str | Mode | None = None, provisional: bool = False,
                    **kwargs) -> Iterator[StreamEvent]:
        """`chat`, streamed as `stream` does: "block" events with the text delta, then "done"."""
        return self.stream(self.chat_prompt(messages), mode=mode, provisional=provisional, **self.chat_options(kwargs))

    def logprobs(self, seqs: list[list[int]], top: int = 0) -> list[tuple[list, list]]:
        """Per sequence of token ids, from one causal (commit-mode) forward: the log-probability of
        each token given the ones before it (None for the first), and the `top` most likely
        (token id, logprob) at each position (None for the first; [] with `top` 0)."""
        res = []
        with torch.inference_mode():
            for ids in seqs:
                x = torch.tensor([ids], dtype=torch.long, device=self.model.device)
                lp = self.model(x)[0].float().log_softmax(-1)[:-1]
                nxt = torch.tensor(ids[1:], dtype=torch.long, device=lp.device)
                chosen = lp.gather(-1, nxt[:, None]).squeeze(-1).tolist()
                if top:
                    v, i = lp.topk(min(top, lp.shape[-1]), dim=-1)
                    tops = [list(zip(ii, vv)) for ii, vv in zip(i.tolist(), v.tolist())]
                else:
                    tops = [[] for _ in chosen]
                res.append(([None] + chosen, [None] + tops))
        return res

    def __repr__(self) -> str:
        c = self.config
        return f"LLM({self.path}, {c.model_type}, layers={c.num_hidden_layers}, experts={c.num_experts if c.has_experts else 0}, dtype={self.model.dtype})"


def _cpu_compute_dtype(path: Path, config) -> torch.dtype | None:
    """None (the stored dtype), or float32 for a half-precision checkpoint on a CPU without native
    half matmuls (`clover.precision`: there a bf16 prefill or denoise step runs up to ~70x slower
    than float32) when the float32 copy fits in half the available memory; otherwise a warning."""
    import warnings

    from .kernels.packed import available_memory
    from .precision import cpu_capability, native_half_matmul

    try:
        stored = parse_dtype(config.torch_dtype)
    except ValueError:  # load_model reports a bad torch_dtype with its own message
        return None
    if stored not in (torch.bfloat16, torch.float16) or native_half_matmul(stored, "cpu"):
        return None
    need = 2 * sum(f.stat().st_size for f in path.glob("*.safetensors"))
    avail = available_memory()
    name = str(stored).replace("torch.", "")
    if need and avail and need <= avail // 2:
        return torch.float32
    warnings.warn(f"{path}: stored in {name}, and this CPU ({cpu_capability()}) has no native {name} matmul: "
                  f"prefill and diffusion steps run far slower than in float32, which would need "
                  f"{need / 2**30:.1f} GiB (available: {avail / 2**30:.1f} GiB); pass dtype='float32' "
                  f"(CLI --dtype float32) if it fits", stacklevel=3)
    return None


def load(path: str | os.PathLike | None = None, *, dtype: str | torch.dtype | None = None, device: str | None = None,
         check_finite: bool | None = None, compile: bool | str = False, drafter: str | os.PathLike | None | bool = None,
         compile_batch: int = 1, calibrate: bool = False, pack: bool | str | None = None) -> LLM:
    """Load a model directory (config.json + safetensors + tokenizer). None = `default_model_path()`.

    `device` is checked first (`check_device`); a missing directory is a FileNotFoundError.
    `dtype` None: the stored dtype, except on a CPU, where the bundled model and any bfloat16/float16
    checkpoint on a CPU without native half matmuls (`clover.precision`) load in float32 when that
    fits in half the available memory. `check_finite` (default: on, or what an enclosing `checkpoint.finite_check(...)` says) scans
    every weight for NaN/Inf; False loads them as they are. `compile=True` (or "static") torch.compiles
    the AR, denoise, block-commit and verify steps whole over static shapes (`clover.models.compile`),
    a bounded set compiled here with a progress bar (`clover.models.static.load_shapes`: the model's
    block size, batch sizes in powers of two below `compile_batch` and `compile_batch` itself, cache capacities up to 512);
    any other shape then runs eagerly, so no request waits on a compile (figures in
    docs/benchmarks.md). `drafter` is a DFlash drafter directory for mode "dflash" (`clover.models.dflash`; refused with one line when it does not fit the model);
    the bundled model comes with its own (`BUNDLED_DRAFTER`), and a model directory may hold its own
    (`<path>/dflash`, `OWN_DRAFTER`: what `clover pull` installs beside clover-smol), loaded unless `drafter=False`.
    `calibrate=True`: speculative draft "auto"'s step costs at the batch
    sizes in powers of two up to `compile_batch` are read from the user cache, or measured here with
    a progress bar and cached (`clover.decoding.speculative.measure_step_curves`: seconds, once per
    model shape, dtype and machine), so that no request waits on them; without it a request meets
    that measurement at the first batch size nothing cached covers.
    `pack` (None: on a CPU, float32, not compiled, with at least 256 MiB of large weights, where the
    copies fit in half the available memory; not the bundled model) keeps a second copy of the large
    weights in oneDNN's layout for forwards of several positions
    (`clover.kernels.packed`: a denoise, block or verify forward in ~1.3-1.5x a GEMV's time instead of
    ~3x; the AR step keeps the plain weights); where the copies do not fit, the row kernel alone
    (`clover.kernels.rows`: forwards of up to 16 positions on the plain weights, one torch thread; no
    memory). True: the copies; "rows": the row kernel alone; False: neither."""
    check_device(device)
    if pack not in (None, True, False, "rows"):
        raise ValueError(f"pack={pack!r}: None (the default), True, False or 'rows'")
    path = model_path(path, device=device) if path is not None else default_model_path()
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such model directory (nor a model name: clover pull lists them)")
    bundled = path.resolve() == BUNDLED_MODEL.resolve()
    dtype = parse_dtype(dtype)
    config = read_config(path) if path.is_dir() else None  # read once (load_model reports a missing one)
    if dtype is None and (device is None or str(device) == "cpu"):
        if bundled:
            dtype = torch.float32  # the bundled model is stored in bf16; fp32 matmuls are faster on CPUs
        elif config is not None:
            dtype = _cpu_compute_dtype(path, config)
    model = load_model(path, dtype=dtype, device=device, check_finite=check_finite, config=config)
    if pack is None:
        from .kernels.packed import default_packing

        pack = not compile and default_packing(model)
    if pack:
        from .kernels.packed import pack_model

        pack_model(model, copies=pack is True)
    if drafter is None and bundled and (BUNDLED_DRAFTER / "config.json").is_file():
        drafter = BUNDLED_DRAFTER
    if drafter is None and path.is_dir() and (path / OWN_DRAFTER / "config.json").is_file():
        drafter = path / OWN_DRAFTER
    draft_model = None
    if drafter is not None and drafter is not False:
        from .checkpoint import load_drafter

        draft_model = load_drafter(drafter, model, device=device)
    if compile:
        from .models.compile import compile_model

        compile_model(model, mode="static" if compile is True else compile)
        from tqdm import tqdm

        from .models.static import LOAD_CAPACITIES, batch_buckets, load_shapes

        batches = batch_buckets(compile_batch)
        shapes = load_shapes(model.config, batches=batches, drafter=draft_model)
        drafts = len(batches) * len(LOAD_CAPACITIES) if draft_model is not None else 0
        with tqdm(total=len(shapes) + drafts, desc="compile", unit="graph", file=sys.stderr, dynamic_ncols=True) as bar:
            model.static_steps.warm_all(shapes, bar=bar)
            if draft_model is not None:  # dflash's draft of a full block, at the same batch sizes and capacities
                bar.set_postfix_str("drafter")
                draft_model.compile_static(freezing=model.static_steps.freezing).warm_static(batches, LOAD_CAPACITIES, bar=bar)
    if calibrate and model.config.mask_token_id is not None:  # speculative decoding needs the mask token
        from tqdm import tqdm

        from .decoding.speculative import measure_step_curves, pending_step_curves
        from .decoding.width import BATCH_BUCKETS, batch_bucket

        top = batch_bucket(compile_batch)
        batches = [b for b in BATCH_BUCKETS if b <= top]
        pending = pending_step_curves(model, batches)  # a cached curve is read, with no bar
        with tqdm(total=len(pending), desc="speculative step costs", unit="batch size", file=sys.stderr,
                  dynamic_ncols=True, disable=not pending) as bar:
            measure_step_curves(model, batches, mask_id=model.config.mask_token_id, bar=bar)
    tokenizer = Tokenizer.from_dir(
        path,
        eos_token_id=model.config.eos_token_ids[0] if model.config.eos_token_ids else None,
        mask_token_id=model.config.mask_token_id,
    )
    return LLM(model, tokenizer, path, drafter=draft_model)
