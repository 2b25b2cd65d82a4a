"""Label smoothing against a hand computation, and the padding and normalization rules.

The loss takes logits; log-probabilities are logits too (their log-softmax is
themselves), so the hand computations below pass log-probabilities.
"""

import math

import pytest
import torch

from transformer_mt.train.loss import (
    GPU_BLOCK_ELEMENTS,
    ROWS_PER_BLOCK,
    _blocks,
    label_smoothed_cross_entropy,
    perplexity,
)


def test_three_class_example_by_hand():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]], dtype=torch.float64)
    lprobs = probs.log()
    target = torch.tensor([0, 2])
    eps = 0.1
    # token 1: nll = -ln 0.7; mean over vocab of -lprobs = (-ln .7 - ln .2 - ln .1) / 3
    nll1, smooth1 = -math.log(0.7), -(math.log(0.7) + math.log(0.2) + math.log(0.1)) / 3
    nll2, smooth2 = -math.log(0.6), -(math.log(0.1) + math.log(0.3) + math.log(0.6)) / 3
    expected_loss = (1 - eps) * (nll1 + nll2) + eps * (smooth1 + smooth2)
    loss, nll = label_smoothed_cross_entropy(lprobs, target, eps, ignore_index=-100)
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
    loss, _ = label_smoothed_cross_entropy(lprobs, target, eps, ignore_index=-100)
    assert loss.item() == pytest.approx(-(q * lprobs).sum().item(), rel=1e-12)
    assert loss.item() == pytest.approx(
        torch.nn.functional.cross_entropy(lprobs, target, label_smoothing=eps, reduction="sum").item(), rel=1e-12
    )


def test_padding_contributes_nothing():
    torch.manual_seed(1)
    lprobs = torch.randn(5, 6).log_softmax(-1)
    target = torch.tensor([1, 0, 4, 0, 2])  # 0 is padding
    loss, nll = label_smoothed_cross_entropy(lprobs, target, 0.1, ignore_index=0)
    keep = target != 0
    loss_ref, nll_ref = label_smoothed_cross_entropy(lprobs[keep], target[keep], 0.1, ignore_index=0)
    assert loss.item() == pytest.approx(loss_ref.item())
    assert nll.item() == pytest.approx(nll_ref.item())
    assert nll_ref.item() == pytest.approx(-lprobs[keep].gather(1, target[keep, None]).sum().item())


def test_zero_epsilon_is_plain_nll():
    lprobs = torch.randn(4, 9).log_softmax(-1)
    target = torch.tensor([3, 1, 8, 2])
    loss, nll = label_smoothed_cross_entropy(lprobs, target, 0.0, ignore_index=0)
    assert loss.item() == pytest.approx(nll.item())
    assert nll.item() == pytest.approx(torch.nn.functional.nll_loss(lprobs, target, reduction="sum").item())


def reference(logits: torch.Tensor, target: torch.Tensor, eps: float, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula written out with autograd in fp64: log_softmax, gather, sum over the vocabulary."""
    lprobs = logits.double().log_softmax(-1)
    keep = target != pad
    nll = -(lprobs.gather(1, target[:, None]).squeeze(1) * keep).sum()
    smooth = -(lprobs.sum(-1) * keep).sum()
    return (1 - eps) * nll + eps / logits.size(1) * smooth, nll


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 4e-3)])
def test_gradient_is_softmax_minus_smoothed_target(dtype, tol):
    """Both outputs' gradients, over several blocks of rows, against autograd through the formula in fp64."""
    torch.manual_seed(3)
    rows = 2 * ROWS_PER_BLOCK + 17
    logits = (3 * torch.randn(rows, 40, dtype=torch.float64)).to(dtype).requires_grad_()
    target = torch.randint(1, 40, (rows,))
    target[::5] = 0  # padding
    loss, nll = label_smoothed_cross_entropy(logits, target, 0.1, 0)
    (0.7 * loss + 0.2 * nll).backward()
    exact = logits.detach().double().requires_grad_()
    loss_ref, nll_ref = reference(exact, target, 0.1, 0)
    (0.7 * loss_ref + 0.2 * nll_ref).backward()
    assert logits.grad.dtype == dtype
    assert loss.item() == pytest.approx(loss_ref.item(), rel=tol)
    assert nll.item() == pytest.approx(nll_ref.item(), rel=tol)
    assert torch.allclose(logits.grad.double(), exact.grad, atol=tol, rtol=0)
    assert logits.grad[target == 0].abs().sum() == 0  # padding gets no gradient


def test_shape_errors():
    with pytest.raises(ValueError, match="expected logits"):
        label_smoothed_cross_entropy(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long), 0.1, 0)


def test_perplexity_is_exp_of_nats():
    assert perplexity(math.log(37.0)) == pytest.approx(37.0)
    assert perplexity(1e6) == math.inf


def test_blocks_cover_every_row_once_small_on_a_cpu_large_elsewhere():
    """256 rows at a time on a CPU (cache); on a GPU about 2**26 elements a block (fewer kernel launches)."""
    for device, rows in (("cpu", ROWS_PER_BLOCK), ("meta", GPU_BLOCK_ELEMENTS // 37000)):
        logits = torch.empty(30000, 37000, device=device) if device == "meta" else torch.empty(1000, 37)
        blocks = _blocks(logits)
        covered = [i for block in blocks for i in range(*block.indices(logits.size(0)))]
        assert covered == list(range(logits.size(0)))
        assert blocks[0].stop - blocks[0].start == min(rows, logits.size(0))
