"""Label-smoothed cross-entropy (the paper's epsilon_ls = 0.1), in fairseq's gather + sum form.

Why this form: gathering the target log-probability and summing over the
vocabulary costs two reductions on the (N, V) log-probabilities, where building
a smoothed target distribution for KL divergence would allocate another (N, V)
tensor. Both losses are sums over target tokens, so the caller can normalize by
the number of target tokens in the whole update (all micro-batches, all ranks).
"""

from __future__ import annotations

import math

import torch


def label_smoothed_nll_loss(
    lprobs: torch.Tensor, target: torch.Tensor, epsilon: float, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(loss_sum, nll_sum)`` in nats, summed over the non-padding target tokens.

    Convention (fairseq's): the smoothing mass ``epsilon`` is spread uniformly
    over the whole vocabulary, ``epsilon / V`` per class (the target class
    included), so per token

        loss = (1 - epsilon) * nll + epsilon * mean_over_vocab(-lprobs)

    which is the cross-entropy against the target distribution
    ``(1 - epsilon) * one_hot + epsilon / V``. ``nll`` is the plain negative
    log-likelihood of the target, the quantity perplexity is computed from.

    lprobs: (N, V) log-probabilities (nats); target: (N,) class ids; positions
    where ``target == ignore_index`` contribute nothing to either sum.
    """
    if lprobs.dim() != 2 or target.shape != lprobs.shape[:1]:
        raise ValueError(f"expected lprobs (N, V) and target (N,), got {tuple(lprobs.shape)} and {tuple(target.shape)}")
    target = target.unsqueeze(-1)  # (N, 1)
    pad_mask = target.eq(ignore_index)  # (N, 1)
    nll = -lprobs.gather(dim=-1, index=target.masked_fill(pad_mask, 0))  # (N, 1)
    smooth = -lprobs.sum(dim=-1, keepdim=True)  # (N, 1)
    nll = nll.masked_fill(pad_mask, 0.0)
    smooth = smooth.masked_fill(pad_mask, 0.0)
    nll_sum = nll.sum()
    loss_sum = (1.0 - epsilon) * nll_sum + (epsilon / lprobs.size(-1)) * smooth.sum()
    return loss_sum, nll_sum


def perplexity(nll_per_token: float) -> float:
    """exp(mean NLL in nats per target token); capped so that a diverged run logs inf, not an overflow error."""
    return math.exp(nll_per_token) if nll_per_token < 700 else math.inf
