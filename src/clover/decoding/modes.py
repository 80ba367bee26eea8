"""The decoding-mode registry: the one list of modes that the API, the CLI, the server, bench and
eval read.

A mode is one file in `decoding/` that defines a `Mode` subclass and calls `register(...)` on an
instance; `decoding/__init__.py` imports the file (one line). The mode states what it needs (a mask
token), its own checks on the generation options (beyond the per-option limits every mode shares,
`sampling.LIMITS`), the plan its engine runs (`EngineSpec`: what rows must share to ride in one
forward, and how many positions past prompt + max_new_tokens a row needs), and how to build its engine.

Names resolve once: a front end turns the name it was given (or none: `default_mode(config)`, the
one default) into a `Mode` with `get_mode` and carries that object from then on. Options resolve
once too: `resolve_params` checks them and fills in the model's defaults, then `Mode.plan` turns
them into the frozen `EngineSpec` that the context check, the cache, the batching key and the
engine all read."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .sampling import AUTO, SamplingParams


@dataclass(frozen=True)
class EngineSpec:
    """The plan: what a request's options mean for its engine, resolved once by its mode
    (`Mode.plan`). Rows with equal plans share one engine (the server's batching key); the
    per-row options (acceptance, sampling, stops) stay in each row's `SamplingParams`.

    It holds what changes the forward itself (the width or the auto policy, the expert budget and
    rank, the skips, the draft cut, whether each denoise step is reported) and `reserve`, the one
    number that both the context check (`LLM.check_length` / `room`) and each row's cache
    (`BatchEngine._capacity`) read. `reserve` None: made by `Mode.spec` alone, not resolved against
    the model yet (`Mode.resolve`, which building its engine runs)."""

    mode: "Mode"
    # the fixed width: a diffusion block's positions, or the tokens a verify commits (t and its
    # drafts: speculative, dflash); None where `auto` chooses it, or the mode has none
    width: int | None = None
    expert_budget: int | None = None
    expert_rank: str = "sum"
    provisional: bool = False  # report the block after every denoise step
    skips: tuple[str, ...] = ()  # diffusion's approximate skips ("window", "decoded"); canvas: its cache
    draft_cut: float | None = None  # drafts cut before their first token below this confidence
    auto: bool = False  # the engine picks the width per block or forward (the request's block_size "auto";
    # speculative: the adaptive draft, whose rejected draft's leftover drafts on)
    reserve: int | None = None  # positions a row needs past prompt + max_new_tokens (context and cache)

    @property
    def engine_width(self) -> int | str | None:
        """The width as an engine constructor takes it (`sampling.AUTO` where the engine picks)."""
        return AUTO if self.auto else self.width

    def make_engine(self, model, *, mask_id: int | None, pad_id: int, drafter=None):
        """The engine for rows of this plan (`Mode.make_engine`). `drafter` reaches only a mode that
        drafts with one (`needs_drafter`): a mode that does not may override `make_engine` without it."""
        kw = {"drafter": drafter} if self.mode.needs_drafter else {}
        return self.mode.make_engine(model, self, mask_id=mask_id, pad_id=pad_id, **kw)

    def __str__(self) -> str:
        parts = [self.mode.name] + [f"{k}={v}" for k, v in (("width", self.engine_width),
                                                            ("expert_budget", self.expert_budget)) if v is not None]
        if self.expert_budget is not None:
            parts.append(f"expert_rank={self.expert_rank}")
        return " ".join(parts + [f"skip={'+'.join(self.skips)}"] * bool(self.skips)
                        + [f"draft_cut={self.draft_cut}"] * (self.draft_cut is not None)
                        + (["provisional"] if self.provisional else []))


class Mode:
    name: str = ""
    needs_mask: bool = False  # decodes with the mask token (a Clover checkpoint)
    needs_drafter: bool = False  # decodes with a separate draft model (`clover.load(..., drafter=)`)
    threshold_commit: bool = False  # commits by the confidence threshold (block steps, forced steps)
    reference: str | None = None  # a lossless mode: its greedy tokens equal this mode's
    auto_width: bool = False  # takes block_size="auto" (otherwise "auto" means the model's block size)
    auto_default: bool = False  # block_size unset (nor draft_length): "auto", where it wins in every measured case
    summary: str = ""
    grammar: bool = True  # obeys a row's grammar (clover.grammar); a mode that does not refuses one
    engine: type | None = None  # the `BatchEngine` it builds: its `semantics_implemented` says which models it decodes

    def refusal(self, config) -> str | None:
        """Why this mode cannot decode a model of `config`, in one line (None: it can): every mode but
        the canvas mode needs a model with a commit (`commit_attention` not "full"), and its engine
        the block semantics the config states (a causal verify cannot run SDAR's or LLaDA2's)."""
        if config.commit_attention == "full":
            return (f"mode: {self.name!r} cannot decode a whole-sequence model ({config.model_type}); "
                    "its mode is 'canvas'")
        try:
            if self.engine is not None:
                config.semantics.require("its engine", self.engine.semantics_implemented)
        except ValueError as e:  # the config's ConfigError
            return f"mode: {self.name!r} cannot decode this model ({config.model_type}): {e}"
        return None

    def available(self, config) -> bool:
        """Whether this mode decodes a model of `config` at all (`refusal` says why not)."""
        return self.refusal(config) is None

    def check(self, params: SamplingParams) -> None:
        """Mode-specific checks, after the model's defaults are filled in (ValueError "option: why")."""

    def spec(self, params: SamplingParams, provisional: bool = False) -> EngineSpec:
        """What the options `params` (checked, the model's defaults filled in) mean for the engine:
        the plan before the model's own facts (`resolve`). `provisional`: the caller wants every
        denoise step's block (modes without one ignore it). The hook a mode overrides."""
        return EngineSpec(self)

    def reserve(self, spec: EngineSpec, config=None, drafter=None) -> int:
        """Positions a row of `spec` needs past prompt + max_new_tokens, for the context and its cache
        alike (e.g. one block); `config`: the model's, `drafter`: the draft model the engine decodes
        with (the LLM's own), for a mode that drafts with one."""
        return 0

    def resolve(self, spec: EngineSpec, config=None, drafter=None) -> EngineSpec:
        """`spec` with what needs the model (its config, the drafter) resolved and checked: the
        reserve (a mode may resolve more, e.g. a width its drafter decides). A resolved spec comes
        back as it is."""
        if spec.reserve is not None:
            return spec
        return dataclasses.replace(spec, reserve=self.reserve(spec, config, drafter))

    def plan(self, params: SamplingParams, provisional: bool = False, *, config=None, drafter=None) -> EngineSpec:
        """The plan of rows with options `params`, resolved once: what every front end decodes with
        (`LLM.plan`)."""
        return self.resolve(self.spec(params, provisional), config, drafter)

    def make_engine(self, model, spec: EngineSpec, *, mask_id: int | None, pad_id: int, drafter=None):
        """A `BatchEngine` for rows of `spec` (this mode's plan; one made by `spec` alone is resolved
        first, against the model's config and `drafter`, the draft model of a mode that drafts with one)."""
        spec = self.resolve(spec, model.config, drafter)
        return self.build_engine(model, spec, mask_id=mask_id, pad_id=pad_id, drafter=drafter)

    def build_engine(self, model, spec: EngineSpec, *, mask_id: int | None, pad_id: int, drafter=None):
        """The engine for rows of the resolved `spec`: the hook a mode overrides (`make_engine` resolves)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"Mode({self.name!r})"


_REGISTRY: dict[str, Mode] = {}


def register(mode: Mode) -> Mode:
    if not mode.name or not mode.name.isidentifier():
        raise ValueError(f"a mode needs a name that is an identifier, got {mode.name!r}")
    _REGISTRY[mode.name] = mode
    return mode


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def mode_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get_mode(name: str | Mode) -> Mode:
    """The registered mode of that name (a `Mode` is returned as it is); ValueError naming the
    registered ones otherwise."""
    if isinstance(name, Mode):
        return name
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"mode: must be one of {', '.join(_REGISTRY)}, got {name!r}") from None


def default_mode(config) -> Mode:
    """The mode used when none is named, for every front end (`LLM.generate` / `stream`, the CLI,
    the server): the one the checkpoint states (config `default_mode`), else diffusion for a Clover
    checkpoint (its config has a mask token), ar for a plain AR one."""
    stated = getattr(config, "default_mode", None)
    return get_mode(stated or ("diffusion" if config.mask_token_id is not None else "ar"))


def resolve_params(m: Mode, kwargs: dict, config) -> SamplingParams:
    """The generation options for mode `m`, checked (ValueError "option: why" / TypeError for an
    unknown option), with the model's defaults (`config`: block_size, policy, threshold,
    sub_block, expert_budget) filled in. The one place this happens: `LLM.params` and the transformers export's
    `diffusion_generate` both call it."""
    params = SamplingParams.from_kwargs(**kwargs).check_model(config.vocab_size)
    if params.block_size is None and m.auto_default and params.draft_length is None:
        params.block_size = AUTO
    elif params.block_size is None or (params.block_size == AUTO and not m.auto_width):
        params.block_size = config.block_size
    if params.policy is None:  # a threshold given alone asks for the threshold rule
        params.policy = "threshold" if params.threshold is not None else config.policy
    if params.threshold is None:
        params.threshold = config.threshold
    if params.sub_block is None:
        params.sub_block = config.sub_block
    if params.expert_budget is None:
        params.expert_budget = config.expert_budget
    if params.expert_budget is not None and not config.has_experts:
        raise ValueError("expert_budget: needs a mixture-of-experts backbone; this model's MLP is dense")
    if params.expert_budget is not None and not (
        config.num_experts_per_tok <= params.expert_budget <= config.num_experts
    ):
        raise ValueError(
            f"expert_budget: must lie in [{config.num_experts_per_tok}, {config.num_experts}], got {params.expert_budget}"
        )
    if m.needs_mask and config.mask_token_id is None:
        raise ValueError(f"mode: {m.name!r} needs a mask token; this is a plain AR checkpoint — convert it with `clover convert`")
    m.check(params)
    return params
