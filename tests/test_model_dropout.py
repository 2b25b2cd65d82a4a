"""Dropout's CPU masks from 16-bit lanes: the paper's P_drop, an unbiased scale, a gradient through the same mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from transformer_mt.model.dropout import LANES, Dropout, dropout, keep_scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [0.1, 0.3])
def test_drops_p_of_the_elements_and_scales_the_rest_to_keep_the_mean(dtype: torch.dtype, p: float) -> None:
    torch.manual_seed(0)
    x = torch.ones(400, 1000, dtype=dtype)
    y = dropout(x, p)
    rounded = round(p * LANES) / LANES
    dropped = (y == 0).double().mean().item()
    assert dropped == pytest.approx(rounded, abs=4 * (rounded * (1 - rounded) / x.numel()) ** 0.5)  # 4 sigma
    kept = y[y != 0]
    expected = torch.tensor(1 / (1 - rounded), dtype=dtype)  # the scale, rounded to the dtype as F.dropout's is
    assert torch.equal(kept, expected.expand_as(kept))
    assert y.dtype == dtype and y.shape == x.shape


def test_the_rounded_probability_is_within_one_lane_of_p() -> None:
    x = torch.ones(8)
    for p in (0.1, 0.2, 0.3, 0.5):
        scale = keep_scale(x, p).max().item()
        assert 1 / (1 - p) == pytest.approx(scale, rel=2 / LANES)


def test_every_lane_of_a_draw_is_uniform() -> None:
    """Each of the four 16-bit lanes of a 64-bit draw drops with the same probability (no lane is biased)."""
    torch.manual_seed(1)
    kept = keep_scale(torch.ones(200_000, 4), 0.5) != 0  # column j = lane j of each draw
    for lane in kept.double().mean(dim=0).tolist():
        assert lane == pytest.approx(0.5, abs=4 * (0.25 / 200_000) ** 0.5)


def test_odd_sizes_and_non_contiguous_inputs() -> None:
    torch.manual_seed(2)
    x = torch.randn(7, 13).t()  # 91 elements, not a multiple of 4, transposed
    y = dropout(x, 0.5)
    assert y.shape == x.shape
    assert torch.equal(y[y != 0], x[y != 0] * 2)


def test_the_gradient_goes_through_the_same_mask() -> None:
    torch.manual_seed(3)
    x = torch.randn(50, 60, requires_grad=True)
    y = dropout(x, 0.2)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, y.detach() / x.detach())


def test_the_same_seed_gives_the_same_mask() -> None:
    x = torch.randn(30, 40)
    torch.manual_seed(4)
    a = dropout(x, 0.1)
    torch.manual_seed(4)
    assert torch.equal(a, dropout(x, 0.1))
    assert not torch.equal(a, dropout(x, 0.1))


def test_eval_p_zero_and_p_one_are_f_dropouts() -> None:
    x = torch.randn(10, 10)
    assert torch.equal(dropout(x, 0.1, training=False), x)
    assert torch.equal(dropout(x, 0.0), x)
    assert torch.equal(dropout(x, 1.0), F.dropout(x, 1.0))  # all zeros
    for p in (1e-6, 1 - 1e-6):  # 16 bits would round them to 0 and 1
        torch.manual_seed(5)
        ours = dropout(x, p)
        torch.manual_seed(5)
        assert torch.equal(ours, F.dropout(x, p))


def test_the_module_follows_train_and_eval() -> None:
    module = Dropout(0.5)
    x = torch.ones(1000)
    assert (module(x) == 0).any()
    module.eval()
    assert torch.equal(module(x), x)
    assert isinstance(module, torch.nn.Dropout) and not list(module.parameters())
