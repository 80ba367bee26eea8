"""The decoding-mode registry: the one list of modes that the API, the CLI, the server, bench and
eval read.

A mode is one file in `decoding/` that defines a `Mode` subclass and calls `register(...)` on an
instance; `decoding/__init__.py` imports the file (one line). The mode states what it needs (a mask
token), its own checks on the generation options (beyond the per-option limits every mode shares,
`sampling.LIMITS`), how many positions past prompt + max_new_tokens it needs in the context, which
options rows must share to ride in one forward (its batching key), and how to build its engine."""

from __future__ import annotations

from .sampling import AUTO, SamplingParams


class Mode:
    name: str = ""
    needs_mask: bool = False  # decodes with the mask token (a Clover checkpoint)
    threshold_commit: bool = False  # commits by the confidence threshold (block steps, forced steps)
    reference: str | None = None  # a lossless mode: its greedy tokens equal this mode's
    auto_width: bool = False  # takes block_size="auto" (otherwise "auto" means the model's block size)
    summary: str = ""

    def check(self, params: SamplingParams) -> None:
        """Mode-specific checks, after the model's defaults are filled in (ValueError "option: why")."""

    def extra_positions(self, params: SamplingParams) -> int:
        """Context positions needed beyond prompt + max_new_tokens (e.g. one block)."""
        return 0

    def group(self, params: SamplingParams) -> tuple:
        """Rows whose keys are equal can share a forward (one engine)."""
        return (self.name,)

    def make_engine(self, model, params: SamplingParams, *, mask_id: int | None, pad_id: int,
                    provisional: bool = False):
        """A `BatchEngine` for rows of this mode with options `params` (any row of the group)."""
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


def get_mode(name: str) -> Mode:
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"mode: must be one of {', '.join(_REGISTRY)}, got {name!r}") from None


def resolve_params(mode: str, kwargs: dict, config) -> SamplingParams:
    """The generation options for `mode`, checked (ValueError "option: why" / TypeError for an
    unknown option), with the model's defaults (`config`: block_size, policy, threshold,
    expert_budget) filled in. The one place this happens: `LLM.params` and the transformers export's
    `diffusion_generate` both call it."""
    m = get_mode(mode)
    params = SamplingParams.from_kwargs(**kwargs).check_model(config.vocab_size)
    if params.block_size is None or (params.block_size == AUTO and not m.auto_width):
        params.block_size = config.block_size
    if params.policy is None:  # a threshold given alone asks for the threshold rule
        params.policy = "threshold" if params.threshold is not None else config.policy
    if params.threshold is None:
        params.threshold = config.threshold
    if params.expert_budget is None:
        params.expert_budget = config.expert_budget
    if params.expert_budget is not None and not (
        config.num_experts_per_tok <= params.expert_budget <= config.num_experts
    ):
        raise ValueError(
            f"expert_budget: must lie in [{config.num_experts_per_tok}, {config.num_experts}], got {params.expert_budget}"
        )
    if m.needs_mask and config.mask_token_id is None:
        raise ValueError(f"mode: {mode!r} needs a mask token; this is a plain AR checkpoint — convert it with `clover convert`")
    m.check(params)
    return params
