"""Label-smoothed cross-entropy (the paper's epsilon_ls = 0.1) straight from the logits, in one fused function.

Why fused: the loss only needs, per target token, the target's
log-probability and the sum of its log-probabilities, and its gradient is
``softmax - smoothed target``. Computing those in fp32 over blocks of rows,
as a custom autograd function, never builds the fp32 copy, the (N, V)
log-probabilities, the zero-filled gather gradient or the log-softmax
gradient that ``log_softmax`` + gather + sum would, which took a fifth of a
CPU training step at a vocabulary of 8000. Each block is one fused
``log_softmax`` forward and one fused ``softmax`` backward (a third less
time than log-sum-exp and ``exp(z - lse)`` over the same blocks). The logits
may be bf16 (autocast): every sum is taken in fp32 and the gradient is
returned in the logits' dtype.
Both losses are sums over target tokens, so the caller can normalize by the
number of target tokens in the whole update (all micro-batches, all ranks).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

ROWS_PER_BLOCK = 256  # rows of logits taken to fp32 at a time on a CPU (8 MB at a vocabulary of 8000): in cache
GPU_BLOCK_ELEMENTS = 2**26  # on a GPU fewer, larger blocks (256 MB in fp32): each block costs kernel launches


def label_smoothed_cross_entropy(
    logits: Tensor, target: Tensor, epsilon: float, ignore_index: int
) -> tuple[Tensor, Tensor]:
    """Return ``(loss_sum, nll_sum)`` in nats, summed over the non-padding target tokens.

    Convention (fairseq's): the smoothing mass ``epsilon`` is spread uniformly
    over the whole vocabulary, ``epsilon / V`` per class (the target class
    included), so per token

        loss = (1 - epsilon) * nll + epsilon * mean_over_vocab(-log_softmax(logits))

    which is the cross-entropy against the target distribution
    ``(1 - epsilon) * one_hot + epsilon / V``. ``nll`` is the plain negative
    log-likelihood of the target, the quantity perplexity is computed from.

    logits: (N, V) unnormalized scores; target: (N,) class ids; positions
    where ``target == ignore_index`` contribute nothing to either sum.
    """
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"expected logits (N, V) and target (N,), got {tuple(logits.shape)} and {tuple(target.shape)}")
    return _LabelSmoothedCrossEntropy.apply(logits, target, epsilon, ignore_index)


class _LabelSmoothedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, epsilon: float, ignore_index: int) -> tuple[Tensor, Tensor]:
        keep = target.ne(ignore_index)
        safe = target.masked_fill(~keep, 0)  # (N,)
        dtype = _sum_dtype(logits)
        picked = torch.empty(logits.size(0), dtype=dtype, device=logits.device)  # (N,) log p of the target
        smooth = torch.empty_like(picked)  # (N,) sum over the vocabulary of log p
        for rows in _blocks(logits):
            logp = torch.log_softmax(logits[rows], dim=-1, dtype=dtype)  # one fused pass, read in bf16
            picked[rows] = logp.gather(1, safe[rows, None]).squeeze(1)
            smooth[rows] = logp.sum(dim=-1)
        nll_sum = -(picked * keep).sum()
        smooth_sum = -(smooth * keep).sum()  # sum over the vocabulary of -log p
        ctx.save_for_backward(logits, safe, keep)
        ctx.epsilon = epsilon
        return (1.0 - epsilon) * nll_sum + (epsilon / logits.size(1)) * smooth_sum, nll_sum

    @staticmethod
    def backward(ctx, grad_loss: Tensor, grad_nll: Tensor) -> tuple[Tensor, None, None, None]:
        """d/dz: grad_loss * (p - (1 - eps) one_hot - eps / V) + grad_nll * (p - one_hot), 0 on padding."""
        logits, safe, keep = ctx.saved_tensors
        eps, vocab = ctx.epsilon, logits.size(1)
        dtype = _sum_dtype(logits)
        on_p = grad_loss + grad_nll
        on_target = ((1.0 - eps) * grad_loss + grad_nll).to(dtype)
        uniform = grad_loss * (eps / vocab)
        grad = torch.empty_like(logits)
        for rows in _blocks(logits):
            g = torch.softmax(logits[rows], dim=-1, dtype=dtype)  # (n, V), one fused pass
            g.mul_(on_p).sub_(uniform)
            g.scatter_add_(1, safe[rows, None], -on_target.expand(g.size(0), 1))
            grad[rows] = g.mul_(keep[rows, None])
        return grad, None, None, None


def _sum_dtype(logits: Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 logits, fp64 for fp64 (so that tests can check the formula to 1e-12)."""
    return torch.promote_types(logits.dtype, torch.float32)


def _blocks(logits: Tensor) -> list[slice]:
    """Row ranges of ``logits`` (N, V) to take to fp32 one at a time."""
    n, vocab = logits.shape
    rows = ROWS_PER_BLOCK if logits.device.type == "cpu" else max(ROWS_PER_BLOCK, GPU_BLOCK_ELEMENTS // vocab)
    return [slice(start, min(start + rows, n)) for start in range(0, n, rows)]


def perplexity(nll_per_token: float) -> float:
    """exp(mean NLL in nats per target token); capped so that a diverged run logs inf, not an overflow error."""
    return math.exp(nll_per_token) if nll_per_token < 700 else math.inf
