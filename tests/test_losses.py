"""The certainty (entropy-minimisation) term of the stage-2 loss."""

from __future__ import annotations

import math

import torch

from clover.train.losses import certainty_loss, diffusion_step_loss


def test_zero_on_one_hot_predictions():
    logits = torch.full((3, 5), -1e4)
    logits[torch.arange(3), torch.tensor([1, 2, 3])] = 1e4
    loss, n = certainty_loss(logits, torch.tensor([1, 2, 3]))
    assert n == 3 and float(loss) == 0.0


def test_counts_only_correctly_predicted_positions():
    # row 0 right and uncertain, row 1 wrong and uncertain, row 2 right and uniform over the top 2
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 2.0], [5.0, 5.0 - 1e-3, -50.0]])
    target = torch.tensor([0, 0, 0])
    loss, n = certainty_loss(logits, target, temperature=1.0)
    assert n == 2  # row 1's argmax (2) is not its target (0): it does not count

    def entropy(row):
        p = row.softmax(-1)
        return float(-(p * p.log()).sum())

    expected = entropy(logits[0]) + entropy(logits[2])
    assert math.isclose(float(loss), expected, rel_tol=1e-5)
    # counting every masked position would add row 1's entropy: the test above tells them apart
    assert not math.isclose(float(loss), expected + entropy(logits[1]), rel_tol=1e-3)


def test_temperature_sharpens_the_measured_entropy():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    hot, _ = certainty_loss(logits, torch.tensor([0]), temperature=1.0)
    cold, _ = certainty_loss(logits, torch.tensor([0]), temperature=0.5)
    assert float(cold) < float(hot)


def test_gradient_flows_only_through_right_positions():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 2.0]], requires_grad=True)
    loss, _ = certainty_loss(logits, torch.tensor([0, 0]))
    loss.backward()
    assert logits.grad[0].abs().sum() > 0 and float(logits.grad[1].abs().sum()) == 0.0


def test_step_loss_reports_the_term(tiny_llm):
    model = tiny_llm.model
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    kw = dict(mask_token_id=tiny_llm.config.mask_token_id, block_sizes=(8,), ar_weight=0.5, aux_coef=0.01,
              top_k=tiny_llm.config.num_experts_per_tok)
    base, s0 = diffusion_step_loss(model, ids, torch.Generator().manual_seed(1), **kw)
    with_c, s1 = diffusion_step_loss(model, ids, torch.Generator().manual_seed(1), certainty_weight=0.5, **kw)
    assert "certainty" not in s0 and 0.0 <= s1["certain_share"] <= 1.0
    assert math.isclose(float(with_c.detach()), float(base.detach()) + 0.5 * s1["certainty"], rel_tol=1e-4)
