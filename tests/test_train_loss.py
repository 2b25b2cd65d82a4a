"""Label smoothing against a hand computation, and the padding and normalization rules."""

import math

import pytest
import torch

from transformer_mt.train.loss import label_smoothed_nll_loss, perplexity


def test_three_class_example_by_hand():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]], dtype=torch.float64)
    lprobs = probs.log()
    target = torch.tensor([0, 2])
    eps = 0.1
    # token 1: nll = -ln 0.7; mean over vocab of -lprobs = (-ln .7 - ln .2 - ln .1) / 3
    nll1, smooth1 = -math.log(0.7), -(math.log(0.7) + math.log(0.2) + math.log(0.1)) / 3
    nll2, smooth2 = -math.log(0.6), -(math.log(0.1) + math.log(0.3) + math.log(0.6)) / 3
    expected_loss = (1 - eps) * (nll1 + nll2) + eps * (smooth1 + smooth2)
    loss, nll = label_smoothed_nll_loss(lprobs, target, eps, ignore_index=-100)
    assert nll.item() == pytest.approx(nll1 + nll2, rel=1e-12)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-12)


def test_equals_cross_entropy_against_smoothed_target():
    """(1 - eps) * one_hot + eps / V as the target distribution gives the same number."""
    torch.manual_seed(0)
    lprobs = torch.randn(7, 11, dtype=torch.float64).log_softmax(-1)
    target = torch.randint(0, 11, (7,))
    eps = 0.1
    q = torch.full((7, 11), eps / 11, dtype=torch.float64)
    q[torch.arange(7), target] += 1 - eps
    loss, _ = label_smoothed_nll_loss(lprobs, target, eps, ignore_index=-100)
    assert loss.item() == pytest.approx(-(q * lprobs).sum().item(), rel=1e-12)
    assert loss.item() == pytest.approx(
        torch.nn.functional.cross_entropy(lprobs, target, label_smoothing=eps, reduction="sum").item(), rel=1e-12
    )


def test_padding_contributes_nothing():
    torch.manual_seed(1)
    lprobs = torch.randn(5, 6).log_softmax(-1)
    target = torch.tensor([1, 0, 4, 0, 2])  # 0 is padding
    loss, nll = label_smoothed_nll_loss(lprobs, target, 0.1, ignore_index=0)
    keep = target != 0
    loss_ref, nll_ref = label_smoothed_nll_loss(lprobs[keep], target[keep], 0.1, ignore_index=0)
    assert loss.item() == pytest.approx(loss_ref.item())
    assert nll.item() == pytest.approx(nll_ref.item())
    assert nll_ref.item() == pytest.approx(-lprobs[keep].gather(1, target[keep, None]).sum().item())


def test_zero_epsilon_is_plain_nll():
    lprobs = torch.randn(4, 9).log_softmax(-1)
    target = torch.tensor([3, 1, 8, 2])
    loss, nll = label_smoothed_nll_loss(lprobs, target, 0.0, ignore_index=0)
    assert loss.item() == pytest.approx(nll.item())
    assert nll.item() == pytest.approx(torch.nn.functional.nll_loss(lprobs, target, reduction="sum").item())


def test_gradient_flows_and_shape_errors():
    logits = torch.randn(3, 5, requires_grad=True)
    loss, _ = label_smoothed_nll_loss(logits.log_softmax(-1), torch.tensor([1, 2, 3]), 0.1, 0)
    loss.backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    with pytest.raises(ValueError, match="expected lprobs"):
        label_smoothed_nll_loss(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long), 0.1, 0)


def test_perplexity_is_exp_of_nats():
    assert perplexity(math.log(37.0)) == pytest.approx(37.0)
    assert perplexity(1e6) == math.inf
