"""Training losses: AR next-token CE, the router load-balancing loss, and the block-diffusion loss.

Block-diffusion (stage 2, design §6). For each sequence of the batch a block size B is drawn from
`block_sizes`; the sequence is cut into blocks of B tokens and every block gets its own mask ratio
t ~ U(min_mask_ratio, 1]; each position of the block is masked with probability t. With
`complementary=True` the batch holds every sequence twice, once with mask m and once with 1 - m,
so every token is masked exactly once per step. Masked positions hold `mask_token_id` in the noisy
stream.

Targets follow the shift-by-one convention: the hidden state at position i predicts token i+1.
A masked token at position j of a block (j > 0 inside the block) is predicted by the noisy stream's
logits at j-1; a masked token at the first position of a block is predicted by the clean stream's
logits at the position before the block (the last committed position, as in the decoding engine).
The very first token of a sequence has no predictor and never counts.

Normalisation: the masked CE is the mean over all masked (and predictable) tokens of the batch --
with complementary masks every token is counted once per pair, so this is the plain per-token
average and does not need the 1/t weighting of single-mask ELBO estimates.

Total loss = masked_ce + ar_weight * ar_ce(clean stream) + aux_coef * router_aux
             + certainty_weight * certainty (mean entropy at T = certainty_temperature over the masked
               positions whose argmax is already the target; `certainty_loss`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def ar_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token CE: logits [B, T, V] at position i predict ids[:, i+1]."""
    V = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, V).float(), ids[:, 1:].reshape(-1))


def router_aux_loss(router_logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """Switch-style load balancing, averaged over MoE layers.

    Per layer with router logits [N, E]: E * sum_e f_e * P_e, where f_e is the fraction of the N*k
    routing slots sent to expert e (top-k of the softmax) and P_e the mean router probability of
    e. It equals 1 for perfectly uniform routing."""
    if not router_logits:
        return torch.zeros(())
    total = 0.0
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        E = probs.shape[-1]
        idx = probs.topk(top_k, dim=-1).indices
        frac = torch.bincount(idx.reshape(-1), minlength=E).to(probs.dtype) / idx.numel()
        total = total + E * (frac * probs.mean(0)).sum()
    return total / len(router_logits)


@dataclass
class DiffusionBatch:
    clean: torch.Tensor  # [B, T] clean ids
    noisy: torch.Tensor  # [B, k*T]: k noisy copies side by side (k = 2 when complementary), mask_token_id where masked
    mask: torch.Tensor  # [B, k*T] bool, True where masked
    block_size: int

    @property
    def copies(self) -> int:
        return self.noisy.shape[1] // self.clean.shape[1]


def sample_block_sizes(n: int, block_sizes: tuple[int, ...], gen: torch.Generator) -> list[int]:
    choice = torch.randint(len(block_sizes), (n,), generator=gen)
    return [int(block_sizes[i]) for i in choice.tolist()]


def make_masks(
    ids: torch.Tensor,
    block_size: int,
    gen: torch.Generator,
    *,
    mask_token_id: int,
    complementary: bool = True,
    min_mask_ratio: float = 1e-3,
) -> DiffusionBatch:
    """Per-block mask ratios t ~ U(min_mask_ratio, 1], per-position Bernoulli(t) masks."""
    B, T = ids.shape
    if T % block_size:
        raise ValueError(f"sequence length {T} is not a multiple of block size {block_size}")
    nb = T // block_size
    t = min_mask_ratio + (1.0 - min_mask_ratio) * (1.0 - torch.rand(B, nb, 1, generator=gen))  # (min, 1]
    u = torch.rand(B, nb, block_size, generator=gen)
    mask = (u < t).reshape(B, T).to(ids.device)  # drawn on the CPU generator whatever the device
    if complementary:
        mask = torch.cat([mask, ~mask], 1)
    noisy = ids.repeat(1, mask.shape[1] // T).masked_fill(mask, mask_token_id)
    return DiffusionBatch(clean=ids, noisy=noisy, mask=mask, block_size=block_size)


def masked_logits(
    clean_logits: torch.Tensor,
    noisy_logits: torch.Tensor,
    clean: torch.Tensor,
    mask: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The logits that predict each masked (and predictable) token, and its targets: ([N, V], [N]);
    None when nothing is masked. Shift-by-one: a block's first position reads the clean stream.

    clean_logits [B, T, V], clean [B, T]; noisy_logits [B, k*T, V] and mask [B, k*T] for k noisy copies,
    or noisy_logits [N, V]: only the positions `noisy_sources(mask, T, block_size)` selects, in order."""
    B, T = clean.shape
    k = mask.shape[1] // T
    target_mask = mask.reshape(B, k, T).clone()
    target_mask[:, :, 0] = False  # position 0 has no predictor
    b, c, j = target_mask.nonzero(as_tuple=True)
    if b.numel() == 0:
        return None
    at_start = (j % block_size) == 0
    if noisy_logits.dim() == 2:  # packed: row r is the source of the r-th target inside a block
        src = noisy_logits.new_empty(b.numel(), noisy_logits.shape[-1])
        src[at_start] = clean_logits[b[at_start], j[at_start] - 1]
        src[~at_start] = noisy_logits
    else:
        src = torch.where(at_start[:, None], clean_logits[b, j - 1], noisy_logits[b, c * T + j - 1])
    return src, clean[b, j]


def masked_diffusion_ce(
    clean_logits: torch.Tensor,
    noisy_logits: torch.Tensor,
    clean: torch.Tensor,
    mask: torch.Tensor,
    block_size: int,
    *,
    reduction: str = "sum",
) -> tuple[torch.Tensor, int]:
    """CE over masked positions with shift-by-one; returns (loss summed or averaged, count)."""
    got = masked_logits(clean_logits, noisy_logits, clean, mask, block_size)
    if got is None:
        return noisy_logits.sum() * 0.0, 0
    src, target = got
    loss = F.cross_entropy(src.float(), target, reduction="sum")
    n = int(target.numel())
    if reduction == "mean":
        loss = loss / n
    return loss, n


def certainty_loss(logits: torch.Tensor, target: torch.Tensor, *, temperature: float = 0.5) -> tuple[torch.Tensor, int]:
    """Entropy minimisation on the masked positions the model already predicts correctly (LLaDA2's
    CAP, dParallel's certainty forcing): sum over positions whose argmax is the target of the entropy
    of softmax(logits / temperature); returns (sum, count). Positions predicted wrongly do not count:
    sharpening them would make the model confidently wrong, which the threshold rule then commits.
    logits [N, V], target [N]."""
    right = logits.argmax(-1) == target
    n = int(right.sum())
    if n == 0:
        return logits.sum() * 0.0, 0
    logp = (logits[right].float() / temperature).log_softmax(-1)
    return -(logp.exp() * logp).sum(), n


def noisy_sources(mask: torch.Tensor, T: int, block_size: int) -> torch.Tensor:
    """bool [B, k*T]: the noisy positions whose logits the masked CE reads -- j-1 for every masked j
    that is not the first position of a block (those read the clean stream)."""
    B = mask.shape[0]
    m = mask.reshape(B, -1, T)
    inner = (torch.arange(T, device=mask.device) % block_size) != 0  # excludes position 0 as well
    src = torch.zeros_like(m)
    src[:, :, :-1] = m[:, :, 1:] & inner[1:]
    return src.reshape(B, -1)


def diffusion_step_loss(
    model,
    ids: torch.Tensor,
    gen: torch.Generator,
    *,
    mask_token_id: int,
    block_sizes: tuple[int, ...],
    ar_weight: float,
    aux_coef: float,
    top_k: int,
    complementary: bool = True,
    min_mask_ratio: float = 1e-3,
    certainty_weight: float = 0.0,
    certainty_temperature: float = 0.5,
    block_size_gen: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The stage-2 loss of one batch `ids [B, T]`; block sizes are drawn per sequence and sequences
    sharing a block size go through one forward. With `block_size_gen` the whole batch takes one
    block size drawn from it (one forward): a generator shared by all ranks then gives every rank
    the same forward, which FSDP needs (each forward is collective, and FSDP2 does not accumulate
    gradients right when a sharded layer runs twice before one backward); the masks stay per rank."""
    B, T = ids.shape
    if block_size_gen is not None:
        sizes = sample_block_sizes(1, block_sizes, block_size_gen) * B
    else:
        sizes = sample_block_sizes(B, block_sizes, gen)
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(sizes):
        groups.setdefault(s, []).append(i)
    batches = []
    for s in sorted(groups):
        rows = torch.tensor(groups[s], dtype=torch.long)
        batches.append(make_masks(ids[rows], s, gen, mask_token_id=mask_token_id,
                                  complementary=complementary, min_mask_ratio=min_mask_ratio))
    rl: list = []
    diff_sum = 0.0
    n_masked = 0
    ar_sum = 0.0
    n_ar = 0
    cert_sum = 0.0
    n_cert = 0
    for db in batches:
        need = noisy_sources(db.mask, T, db.block_size)
        clean_logits, noisy_logits = model.forward_block_diffusion(
            db.clean, db.noisy, db.block_size, router_logits=rl, noisy_logits_at=need
        )
        got = masked_logits(clean_logits, noisy_logits, db.clean, db.mask, db.block_size)
        if got is not None:
            src, target = got
            diff_sum = diff_sum + F.cross_entropy(src.float(), target, reduction="sum")
            n_masked += int(target.numel())
            if certainty_weight:
                c, nc = certainty_loss(src, target, temperature=certainty_temperature)
                cert_sum = cert_sum + c
                n_cert += nc
        V = clean_logits.shape[-1]
        ar_sum = ar_sum + F.cross_entropy(
            clean_logits[:, :-1].reshape(-1, V).float(), db.clean[:, 1:].reshape(-1), reduction="sum"
        )
        n_ar += db.clean.shape[0] * (T - 1)  # the clean stream once per sequence, however many copies
    diff = diff_sum / max(n_masked, 1)
    ar = ar_sum / max(n_ar, 1)
    aux = router_aux_loss(rl, top_k)
    cert = cert_sum / max(n_cert, 1)
    loss = diff + ar_weight * ar + aux_coef * aux + certainty_weight * cert
    stats = {
        "loss": float(loss.detach()),
        "diff_loss": float(diff.detach()) if torch.is_tensor(diff) else float(diff),
        "ar_loss": float(ar.detach()),
        "aux": float(aux.detach()) if torch.is_tensor(aux) else float(aux),
        "masked": n_masked,
    }
    if certainty_weight:
        stats["certainty"] = float(cert.detach()) if torch.is_tensor(cert) else float(cert)
        stats["certain_share"] = n_cert / max(n_masked, 1)  # masked positions already predicted right
    return loss, stats


def ar_step_loss(model, ids: torch.Tensor, *, aux_coef: float, top_k: int) -> tuple[torch.Tensor, dict[str, float]]:
    rl: list = []
    logits = model(ids, router_logits=rl)
    ar = ar_loss(logits, ids)
    aux = router_aux_loss(rl, top_k)
    loss = ar + aux_coef * aux
    return loss, {"loss": float(loss.detach()), "ar_loss": float(ar.detach()), "aux": float(aux.detach())}


class TargetMemo:
    """The frozen target's outputs on each training row, computed once and kept (keyed by the row's
    tokens): the drafter's context features (bfloat16), the target's argmax, and its `top_k` most
    likely tokens of the (draft) vocabulary with their log-probabilities there. A drafter trained
    for several epochs on one distillation set then runs the target once per document instead of
    once per step, which on a CPU is most of a step (SmolLM2-135M: ~30 GMAC a row against ~10 for
    a 2-layer drafter's forward and backward); the KL is taken over those `top_k` tokens."""

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k
        self.rows: dict[bytes, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def outputs(self, drafter, target, ids: torch.Tensor, real: torch.Tensor):
        """-> (ctx [B, L, F], greedy [B, L], top-k log-probs [B, L, K], their (draft) indices [B, L, K])."""
        B, L = ids.shape
        lengths = real.long().cumsum(-1).argmax(-1) + 1  # up to the row's last real token
        keys = [ids[b, : int(lengths[b])].cpu().numpy().tobytes() for b in range(B)]
        todo = [b for b in range(B) if keys[b] not in self.rows]
        if todo:
            with torch.no_grad():
                hidden = dict.fromkeys(drafter.target_layer_ids)
                logits = target(ids[todo], hidden_out=hidden).float()
                ctx = drafter.context_features(hidden, target)
                greedy = logits.argmax(-1)
                if drafter.draft_ids is not None:
                    logits = logits[..., drafter.draft_ids.to(logits.device)]
                lp, idx = logits.log_softmax(-1).topk(self.top_k, dim=-1)
            for j, b in enumerate(todo):
                n = int(lengths[b])
                self.rows[keys[b]] = (ctx[j, :n].to(torch.bfloat16), greedy[j, :n].int(), lp[j, :n].half(), idx[j, :n].int())
        F_, K = drafter.fc.in_features, self.top_k
        ctx = torch.zeros(B, L, F_, dtype=drafter.dtype, device=ids.device)
        greedy = torch.zeros(B, L, dtype=torch.long, device=ids.device)
        lp = torch.zeros(B, L, K, device=ids.device)
        idx = torch.zeros(B, L, K, dtype=torch.long, device=ids.device)
        for b in range(B):
            c, g, l_, i_ = self.rows[keys[b]]
            n = c.shape[0]
            ctx[b, :n], greedy[b, :n], lp[b, :n], idx[b, :n] = c, g, l_, i_
        return ctx, greedy, lp, idx


def dflash_step_loss(drafter, target, ids: torch.Tensor, gen: torch.Generator, *, anchors: int, decay: float,
                     kl_weight: float, pad_id: int | None = None,
                     memo: TargetMemo | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The DFlash drafter's training loss (arXiv 2602.06036) on a batch `ids` [B, L], the target frozen.

    The target runs once over the batch (no grad): its logits and the hidden states of the drafter's
    target layers. Per row, `anchors` random anchor positions a (each with a whole block inside the
    row) each give one block `[ids[a], mask x (Bs-1)]` that sees the context of positions < a; block
    position k predicts the token the target's greedy chain puts at a+k. That chain is known where the
    data is the target's own greedy output: position k counts while ids[a+1 .. a+k-1] equal the
    target's argmax after each of their prefixes (in AR greedy text, always; in a prompt, the block
    stops counting at the first token greedy decoding would not have written). The label is the
    target's argmax at a+k-1 (cross-entropy) and its distribution there (KL(p_target || p_draft),
    weight `kl_weight`); position k weighs exp(-(k-1)/decay), since a draft is only accepted up to
    its first miss. Anchors are drawn where decoding puts them, on tokens the target wrote (a token
    equal to its argmax after the prefix), prompt tokens 20x less often. With `pad_id`, rows are
    right-padded documents: anchors are drawn from their tokens and a block stops counting at the padding. Reported: `accept_len`, the mean accepted length per block that these
    predictions would give in a verify (the anchor's successor counted as 1 + leading hits).
    With a reduced draft vocabulary (`drafter.draft_ids`), both terms live on it (the target's
    distribution renormalised over it), and a block stops counting at a label outside it: the
    drafter can never write that token, so no later position of the block is reached. With `memo`
    the target's outputs come from it (`TargetMemo`) and the KL is over its top-k tokens, renormalised."""
    B, L = ids.shape
    Bs = drafter.block_size
    if L <= Bs:
        raise ValueError(f"data.seq_len ({L}) must exceed the drafter's block_size ({Bs})")
    A = max(1, min(anchors, L - Bs))
    real = (ids != pad_id) if pad_id is not None else torch.ones_like(ids, dtype=torch.bool)
    if memo is not None:
        ctx, greedy, top_lp, top_idx = memo.outputs(drafter, target, ids, real)
    else:
        with torch.no_grad():
            hidden = dict.fromkeys(drafter.target_layer_ids)
            t_logits = target(ids, hidden_out=hidden).float()  # [B, L, V]
            ctx = drafter.context_features(hidden, target)
            greedy = t_logits.argmax(-1)  # [B, L]: the target's token after position i
    written = torch.zeros_like(real)  # token i is the one the target writes after i-1: where decoding anchors
    written[:, 1:] = ids[:, 1:] == greedy[:, :-1]
    # anchors in [1, L - Bs] on real tokens, mostly on tokens the target wrote (a prompt's are rarely drawn)
    weight = (real & written).float()[:, 1 : L - Bs + 1].cpu() + 0.05 * real[:, 1 : L - Bs + 1].float().cpu() + 1e-6
    anchor = (torch.multinomial(weight, A, replacement=bool((weight > 0.5).sum(-1).min() < A), generator=gen) + 1)
    anchor = anchor.sort(-1).values.to(ids.device)  # [B, A]
    k = torch.arange(1, Bs, device=ids.device)
    pred_pos = anchor[:, :, None] + k - 1  # [B, A, Bs-1]: the target position whose argmax is the label
    rows = torch.arange(B, device=ids.device)[:, None, None]
    labels = greedy[rows, pred_pos]
    on_chain = ids[rows, pred_pos] == greedy[rows, pred_pos - 1]  # data token at a+k-1 is the target's
    on_chain[:, :, 0] = True  # k = 1 follows the anchor itself
    valid = (on_chain & real[rows, pred_pos]).cumprod(-1).bool()
    t_pred = t_logits[rows, pred_pos] if memo is None else None  # [B, A, Bs-1, V]
    vocab = drafter.draft_ids
    if vocab is not None:  # labels as draft indices; a label outside the draft vocabulary ends the block
        vocab = vocab.to(ids.device)
        index = torch.full((drafter.config.vocab_size,), -1, dtype=torch.long, device=ids.device)
        index[vocab] = torch.arange(vocab.numel(), device=ids.device)
        labels = index[labels]
        valid = (valid & (labels >= 0)).cumprod(-1).bool()
        labels = labels.clamp_min(0)
        t_pred = t_pred[..., vocab] if t_pred is not None else None
    block = torch.full((B, A, Bs), drafter.mask_token_id, dtype=torch.long, device=ids.device)
    block[:, :, 0] = ids[rows[:, :, 0], anchor]
    h = drafter.forward_train(ctx, anchor, drafter.embed(block, target))
    logits = drafter.draft_logits(h[:, :, 1:], target).float()  # [B, A, Bs-1, V or V_d]
    w = torch.exp(-(k - 1).float() / decay)[None, None, :] * valid
    logp = logits.log_softmax(-1)
    ce = -logp.gather(-1, labels[..., None]).squeeze(-1)
    if memo is None:
        t_logp = t_pred.log_softmax(-1)
        kl = (t_logp.exp() * (t_logp - logp)).sum(-1)
    else:  # over the target's top-k tokens, renormalised
        t_logp = top_lp[rows, pred_pos].log_softmax(-1)
        kl = (t_logp.exp() * (t_logp - logp.gather(-1, top_idx[rows, pred_pos]))).sum(-1)
    denom = w.sum().clamp_min(1e-9)
    loss = ((1 - kl_weight) * (ce * w).sum() + kl_weight * (kl * w).sum()) / denom
    with torch.no_grad():
        hit = (logits.argmax(-1) == labels) & valid
        accept_len = 1 + hit.long().cumprod(-1).sum(-1).float().mean()
        acc = hit.sum() / valid.sum().clamp_min(1)
    ce, kl = ce.detach(), kl.detach()
    return loss, {"loss": float(loss.detach()), "ce": float((ce * w).sum() / denom), "kl": float((kl * w).sum() / denom),
                  "acc": float(acc), "accept_len": float(accept_len), "valid": float(valid.float().mean())}
