"""Multi-head attention (paper section 3.2) on top of PyTorch's fused kernel.

Both modules keep the paper's parameters exactly (four d_model x d_model
projections with biases per attention); self-attention stores W_Q, W_K, W_V as
one (3D, D) matrix and cross-attention stores W_K, W_V as one (2D, D) matrix so
each needs a single matmul. Heads live on dim 1, as
`torch.nn.functional.scaled_dot_product_attention` expects: (B, H, T, D/H).

Masks follow that function: a boolean mask is True where a query MAY attend.

In beam search the k hypotheses of a sentence sit in k consecutive rows and
share that sentence's encoder output. `group_queries` puts their queries side
by side in one row, so that they attend to keys/values held once per sentence
(broadcast, never copied per beam); `ungroup` undoes it.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


def split_heads(x: Tensor, parts: int, heads: int) -> tuple[Tensor, ...]:
    """(B, T, parts*D) -> `parts` views of shape (B, H, T, D/H), without copying."""
    B, T, _ = x.shape
    x = x.view(B, T, parts, heads, -1)  # (B, T, parts, H, Dh)
    return tuple(x.permute(2, 0, 3, 1, 4).unbind(0))  # parts x (B, H, T, Dh)


def group_queries(q: Tensor, groups: int) -> Tensor:
    """(B*G, H, T, Dh) -> (B, H, G*T, Dh): the G consecutive rows of each group become one row of G*T queries."""
    if groups == 1:
        return q
    BG, H, T, Dh = q.shape
    return q.unflatten(0, (BG // groups, groups)).transpose(1, 2).reshape(BG // groups, H, groups * T, Dh)


def ungroup(y: Tensor, groups: int) -> Tensor:
    """(B, H, G*T, Dh) -> (B*G, H, T, Dh), the inverse of `group_queries`."""
    if groups == 1:
        return y
    B, H, GT, Dh = y.shape
    return y.unflatten(2, (groups, GT // groups)).transpose(1, 2).flatten(0, 1)


def merge_heads(x: Tensor) -> Tensor:
    """(B, H, T, Dh) -> (B, T, H*Dh)."""
    B, H, T, Dh = x.shape
    return x.transpose(1, 2).reshape(B, T, H * Dh)


class SelfAttention(nn.Module):
    """Queries, keys and values all come from the same sequence."""

    def __init__(self, d_model: int, heads: int, attention_dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.attention_dropout = attention_dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)  # W_Q, W_K, W_V stacked
        self.out = nn.Linear(d_model, d_model)  # W_O

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Per-head queries, keys and values of x (B, T, D): three (B, H, T, Dh) views."""
        q, k, v = split_heads(self.qkv(x), 3, self.heads)
        return q, k, v

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, is_causal: bool = False, groups: int = 1
    ) -> Tensor:
        """softmax(Q K^T / sqrt(d_k)) V for all heads, then W_O: (B, H, T, Dh) x3 -> (B, T, D).

        With ``groups`` G > 1, q holds B*G rows and k, v hold B rows: each
        group of G consecutive query rows attends to one row of keys/values.
        """
        p = self.attention_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(
            group_queries(q, groups), k, v, attn_mask=mask, dropout_p=p, is_causal=is_causal
        )
        return self.out(merge_heads(ungroup(y, groups)))  # (B*G, T, D)

    def forward(self, x: Tensor, mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        """Attention of x (B, T, D) over itself; mask broadcasts to (B, H, T, T)."""
        q, k, v = self.project(x)
        return self.attend(q, k, v, mask, is_causal)


class CrossAttention(nn.Module):
    """Decoder queries attend over the encoder output ("memory")."""

    def __init__(self, d_model: int, heads: int, attention_dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.attention_dropout = attention_dropout
        self.q = nn.Linear(d_model, d_model)  # W_Q
        self.kv = nn.Linear(d_model, 2 * d_model)  # W_K, W_V stacked
        self.out = nn.Linear(d_model, d_model)  # W_O

    def project_memory(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Per-head keys and values of the encoder output (B, S, D): two (B, H, S, Dh) views."""
        k, v = split_heads(self.kv(memory), 2, self.heads)
        return k, v

    def forward(self, x: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """Attention of x (B*G, T, D) over memory keys/values (B, H, S, Dh); mask broadcasts to (B, H, G*T, S).

        G = x rows per memory row: 1 in training, the beam size in beam search,
        whose k beams of a sentence read its memory once instead of k copies.
        """
        groups = x.shape[0] // k.shape[0]
        (q,) = split_heads(self.q(x), 1, self.heads)  # (B*G, H, T, Dh)
        p = self.attention_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(group_queries(q, groups), k, v, attn_mask=mask, dropout_p=p)
        return self.out(merge_heads(ungroup(y, groups)))  # (B*G, T, D)
