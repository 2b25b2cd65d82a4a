"""Dropout (paper section 5.4, P_drop) with masks drawn 16 bits at a time on the CPU.

Why not `torch.nn.functional.dropout` there: on the CPU it draws one random
number per element from a Bernoulli sampler, 9 ms for a (4096 x 512) bf16
activation on one core, 8% of a base-model training step in bf16. One
64-bit draw gives the random bits of four elements instead: an element is
kept where its 16-bit lane is at least a threshold, and the kept elements are
scaled by 1 / (1 - p), a quarter of the random draws and about a quarter of
the time. The probability is p rounded to a multiple of 1/65536 (0.1 becomes
0.100006), and the scale uses that rounded p, so the expectation of each
output element stays its input. On a GPU, `F.dropout` (one fused kernel) is
used as it is, and so under `torch.compile`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LANES = 1 << 16  # values a 16-bit lane takes


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """``F.dropout(x, p, training)``, with the CPU's mask from 16-bit lanes of 64-bit draws (`keep_scale`).

    A p that rounds to 0 or 1 in 16 bits (under 1/131072 from either) takes `F.dropout` as it is, and so
    does a model under `torch.compile` (``train.compile``), which generates its own random numbers in its
    fused kernels and would otherwise compile a graph for every activation size.
    """
    cpu = x.device.type == "cpu" and not torch.compiler.is_compiling()
    if not training or not cpu or not 0 < round(p * LANES) < LANES:
        return F.dropout(x, p, training)
    return x * keep_scale(x, p)


def keep_scale(x: Tensor, p: float) -> Tensor:
    """A tensor shaped and typed as ``x``: 1 / (1 - p') where an element is kept, 0 where dropped.

    p' is p rounded to a multiple of 1/65536, the probability that a uniform
    16-bit lane falls below the threshold.
    """
    dropped = round(p * LANES)
    n = x.numel()
    bits = torch.empty((n + 3) // 4, dtype=torch.int64, device=x.device).random_(-(2**63), None)  # every bit uniform
    lanes = bits.view(torch.int16)[:n].view(x.shape)
    keep = torch.empty_like(x, memory_format=torch.contiguous_format)
    torch.ge(lanes, dropped - LANES // 2, out=keep)  # int16 lanes are uniform on [-32768, 32767]
    return keep.mul_(LANES / (LANES - dropped))


class Dropout(nn.Dropout):
    """`nn.Dropout` computed by `dropout`: the same module (no parameters, ``p``, train/eval), a faster CPU mask."""

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)
