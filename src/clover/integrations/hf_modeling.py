"""The transformers face of a Clover model (`modeling_clover.py` in an export).

`clover export-hf` writes this module and every clover module it imports (the Qwen3.5 family
model, the cache, the kernels, the decoding engines) into the export directory, with the relative
imports rewritten to the flat files transformers' remote-code loader understands
(`clover.export.hf`). So the code transformers runs is clover's own, and needs only torch and
transformers.

`CloverForCausalLM` holds the backbone's `model` and `lm_head` under their clover names (the
safetensors load as they are) and delegates to clover's model:
- `forward(input_ids, attention_mask, cache, labels, ...)`: commit (causal) mode; left- or
  right-padded batches; with a cache (`generate`), clover's `step` on a `CloverCache`;
- `generate(...)`: transformers' own loop (greedy, sampling, logits processors) over that cache;
- `diffusion_generate(...)`: clover's engines — block diffusion with the prefix cache and the fused
  commit, `mode="speculative"` (greedy, equal to AR) and `mode="ar"` — with clover's options.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import ModelOutput

from ..cache import DeltaNetState, HybridCache
from ..decoding.ar import AR
from ..decoding.base import RowState
from ..decoding.diffusion import Diffusion
from ..decoding.modes import get_mode, resolve_params
from ..decoding.speculative import Speculative
from ..models.layers import Experts, GatedDeltaNet, GatedRMSNorm, RMSNorm, denoise_parameters
from ..export.hf_configuration import CloverHFConfig
from ..models import model_class

MODES = (AR.name, Diffusion.name, Speculative.name)  # what diffusion_generate runs (registered on import)


def backbone_class(config) -> type[nn.Module]:
    """clover's model class for a Clover config (its `backbone`), as the registry says."""
    return model_class(config)


class CloverCache:
    """The cache `generate` carries between forwards: clover's `HybridCache` (per GDN layer the
    recurrent and conv state, per attention layer K/V; rows advance independently) plus the number
    of input columns seen, padding included — the length transformers counts."""

    is_compileable = False

    def __init__(self, cache: HybridCache, seen: int = 0) -> None:
        self.cache = cache
        self.seen = seen

    @property
    def is_linear(self) -> list[bool]:
        return [isinstance(s, DeltaNetState) for s in self.cache.layers]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def __len__(self) -> int:
        return len(self.cache.layers)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.cache = self.cache.select_rows(beam_idx)


@dataclass
class CloverGenerateOutput(ModelOutput):
    """`diffusion_generate(..., return_dict_in_generate=True)`: the sequences (prompt, then the
    generated tokens, right-padded with pad_token_id) and per row what clover's engine reports."""

    sequences: torch.LongTensor | None = None
    forwards: list[int] | None = None  # model forwards per row (NFE)
    finish_reasons: list[str] | None = None  # "stop" or "length" per row
    block_steps: list[list[int]] | None = None  # denoise steps per block (diffusion)
    accept_lengths: list[list[int]] | None = None  # tokens per iteration (speculative)


def _left_aligned(ids: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A left-padded batch -> (ids with each row's tokens moved to the front, valid tokens per row,
    shift per row); None when no row starts with padding. Padding anywhere but at one end is refused."""
    if mask is None:
        return None
    mask = mask[:, -ids.shape[1]:].bool()
    if bool(mask.all()):
        return None
    T = ids.shape[1]
    n = mask.sum(1)
    t = torch.arange(T, device=ids.device)
    right = bool((mask == (t[None, :] < n[:, None])).all())
    if right:
        return None  # causal attention: trailing padding never reaches the tokens before it
    left = bool((mask == (t[None, :] >= (T - n)[:, None])).all())
    if not left or bool((n == 0).any()):
        raise ValueError("attention_mask: padding must be on one side of each row (left or right), and no row may be empty")
    shift = T - n
    return ids.gather(1, (t[None, :] + shift[:, None]) % T), n, shift


def _restore_layout(logits: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Undo `_left_aligned` on [B, T, V] logits."""
    T = logits.shape[1]
    t = torch.arange(T, device=logits.device)
    idx = (t[None, :] - shift[:, None]) % T
    return logits.gather(1, idx[..., None].expand(-1, -1, logits.shape[-1]))


class CloverPreTrainedModel(PreTrainedModel):
    config_class = CloverHFConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]
    supports_gradient_checkpointing = False
    _is_stateful = True  # the GDN state cannot be cropped: no assisted decoding through transformers

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """clover's initialisation (`init_weights`), for weights a checkpoint does not hold."""
        c = self.core.config
        std = c.initializer_range
        if isinstance(module, RMSNorm):
            init.zeros_(module.weight)
        elif isinstance(module, GatedRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, Experts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, GatedDeltaNet):
            init.normal_(module.conv1d.weight, mean=0.0, std=1.0 / math.sqrt(c.linear_conv_kernel_dim))
            init.copy_(module.A_log, torch.empty(module.A_log.shape).uniform_(1.0, 16.0).log())
            dt = torch.exp(torch.empty(module.dt_bias.shape).uniform_(math.log(1e-3), math.log(1e-1)))
            init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))
            if module.has_denoise_params:
                for name, value in denoise_parameters(c).items():
                    init.copy_(module.get_parameter(name), value)


class CloverForCausalLM(CloverPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: CloverHFConfig) -> None:
        super().__init__(config)
        model_config = config.model_config()
        core = backbone_class(model_config)(model_config)
        self.model = core.model  # the same modules as clover's model: its parameter names
        self.lm_head = core.lm_head
        self.__dict__["_core"] = core  # not a submodule: its modules are this model's
        self.post_init()

    @property
    def core(self) -> nn.Module:
        """clover's model over this model's modules (an `lm_head` swapped in since is followed)."""
        core = self.__dict__["_core"]
        if core.lm_head is not self.lm_head:
            core.lm_head = self.lm_head
        if core.model is not self.model:
            core.model = self.model
        return core

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the first forward of `generate` builds a CloverCache

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.lm_head = value

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: CloverCache | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        inputs_embeds: torch.Tensor | None = None,
        past_key_values: CloverCache | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Commit (causal) mode. Without a cache: the plain causal forward (training, scoring). With
        `use_cache=True` (as `generate` passes) or a `cache`: clover's cached `step`, whose cache comes
        back in `.cache`. `labels` (-100 = ignored) give the next-token loss, shifted inside."""
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("input_ids: required (inputs_embeds is not supported)")
        cache = cache if cache is not None else past_key_values
        if cache is None and use_cache:
            cache = CloverCache(self.core.make_cache(input_ids.shape[0], input_ids.shape[1] + 64))
        if cache is not None:
            logits = self._cached(cache, input_ids, attention_mask, logits_to_keep)
        else:
            logits = self._causal(input_ids, attention_mask)
            if logits_to_keep:
                logits = logits[:, -logits_to_keep:]
        loss = None
        if labels is not None:
            if logits.shape[1] != labels.shape[1]:
                raise ValueError("labels: need the logits of every position (logits_to_keep=0, no cache)")
            shift_logits = logits[:, :-1].float().reshape(-1, logits.shape[-1])
            shift_labels = labels[:, 1:].reshape(-1).to(shift_logits.device)
            num_items = kwargs.get("num_items_in_batch")
            if num_items is None:
                loss = F.cross_entropy(shift_logits, shift_labels, ignore_index=-100)
            else:
                loss = F.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum") / num_items
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)

    def _causal(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        aligned = _left_aligned(input_ids, attention_mask)
        if aligned is None:
            return self.core(input_ids)
        ids, _, shift = aligned
        return _restore_layout(self.core(ids), shift)

    def _cached(self, cache: CloverCache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                logits_to_keep: int) -> torch.Tensor:
        core = self.core
        B, T = input_ids.shape
        last_only = logits_to_keep == 1
        aligned = _left_aligned(input_ids, attention_mask)
        if aligned is not None:
            if bool((cache.cache.lengths != 0).any()):
                raise ValueError("attention_mask: padding is only supported in the first forward (the prompt)")
            ids, n, shift = aligned
            out = core.step(cache.cache, commit_ids=ids, n_commit=n, all_logits=not last_only)
            logits = out.commit_logits[:, None] if last_only else _restore_layout(out.commit_logits, shift)
        else:
            out = core.step(cache.cache, commit_ids=input_ids, all_logits=not last_only)
            logits = out.commit_logits[:, None] if last_only else out.commit_logits
        cache.seen += T
        if logits_to_keep and not last_only:
            logits = logits[:, -logits_to_keep:]
        return logits

    # ------------------------------------------------------- clover's engines
    @torch.no_grad()
    def diffusion_generate(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int = 256,
        mode: str = "diffusion",
        block_size: int | None = None,
        threshold: float | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        stop_token_ids: list[int] | None = None,
        stop_strings: str | list[str] | None = None,
        tokenizer=None,
        return_dict_in_generate: bool = False,
        **options,
    ) -> torch.LongTensor | CloverGenerateOutput:
        """Generate with clover's engines. `mode`: "diffusion" (block diffusion: every masked position
        whose confidence reaches `threshold` commits; the prefix cache; a finished block committed in
        the same forward as the next block's first denoise step), "speculative" (a denoise draft
        verified causally; greedy only, equal to AR) or "ar". `block_size`, `threshold`, `policy` and
        `expert_budget` default to the config's, as in clover (`resolve_params`). Other options are
        clover's (`policy`, `fallback`, `factor`, `low_threshold`, `entropy_budget`, `sub_block`,
        `confidence`, `expert_budget`, `draft_length`,
        `repetition_penalty`, `presence_penalty`, `eos_penalty`, `no_repeat_ngram_size`,
        `ignore_eos`; docs/diffusion.md). `stop_strings` need `tokenizer`. Rows of a padded batch
        (left or right, per `attention_mask`) are decoded together.

        Returns the sequences [B, T + new] (prompt as given, then each row's tokens, padded with
        pad_token_id), or with `return_dict_in_generate=True` a `CloverGenerateOutput` that also holds
        the forwards per row."""
        c = self.core.config
        if mode not in MODES:
            raise ValueError(f"mode: must be one of {', '.join(MODES)}, got {mode!r}")
        stop = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings or [])
        if stop and tokenizer is None:
            raise ValueError("stop_strings: pass tokenizer= to decode the output")
        m = get_mode(mode)
        params = resolve_params(m, dict(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
            stop=stop, stop_token_ids=list(stop_token_ids or []), block_size=block_size, threshold=threshold,
            **options), c)
        if eos_token_id is None:
            eos_token_id = self.generation_config.eos_token_id
        if eos_token_id is None:
            eos_token_id = c.eos_token_id
        eos = set(eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id] if eos_token_id is not None else [])
        if pad_token_id is None:
            pad_token_id = self.generation_config.pad_token_id
        if pad_token_id is None:
            pad_token_id = c.pad_token_id if c.pad_token_id is not None else 0
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        prompts = [row[keep].tolist() for row, keep in zip(input_ids, mask)]
        if any(not p for p in prompts):
            raise ValueError("input_ids: every row needs at least one token")
        decode = tokenizer.decode if tokenizer is not None else None
        rows = [RowState(p, params, eos, decode=decode) for p in prompts]
        engine = m.plan(params, config=c).make_engine(self.core, mask_id=c.mask_token_id, pad_id=pad_token_id)
        for r in rows:
            for _ in engine.add(r):
                pass
        for _ in engine.run():
            pass
        width = max(len(r.tokens) for r in rows)
        new = torch.full((len(rows), width), pad_token_id, dtype=input_ids.dtype, device=input_ids.device)
        for i, r in enumerate(rows):
            if r.tokens:
                new[i, : len(r.tokens)] = torch.tensor(r.tokens, dtype=input_ids.dtype)
        sequences = torch.cat([input_ids, new], dim=1)
        if not return_dict_in_generate:
            return sequences
        return CloverGenerateOutput(
            sequences=sequences,
            forwards=[r.forwards for r in rows],
            finish_reasons=[r.finish_reason or "length" for r in rows],
            block_steps=[list(r.block_steps) for r in rows],
            accept_lengths=[list(r.accept_lengths) for r in rows],
        )
