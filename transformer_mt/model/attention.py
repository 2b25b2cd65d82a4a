"""Multi-head attention (paper section 3.2) on top of PyTorch's fused kernel.

Both modules keep the paper's parameters exactly (four d_model x d_model
projections with biases per attention); self-attention stores W_Q, W_K, W_V as
one (3D, D) matrix and cross-attention stores W_K, W_V as one (2D, D) matrix so
each needs a single matmul. Heads live on dim 1, as
`torch.nn.functional.scaled_dot_product_attention` expects: (B, H, T, D/H).

Queries and keys are d_k wide per head and values d_v = d_model/h; the paper
sets d_k = d_v, and Table 3 row (B) shrinks d_k alone (``model.d_k``), so W_Q
and W_K become (h*d_k, D) while W_V and W_O keep their shapes. The fused
kernel takes keys narrower than values and scales by 1/sqrt(d_k).

Masks follow that function: a boolean mask is True where a query MAY attend;
a float mask is added to the scores (0 where allowed, -inf elsewhere).

The fused kernel never forms the attention weights. To draw them (the
paper's Figures 3-5), pass a list as ``weights``: the modules then take the
explicit path, softmax(Q K^T / sqrt(d_k)) V, and append the weights to it
(`explicit_attention`); training and decoding pass nothing and stay fused.

In beam search the k hypotheses of a sentence sit in k consecutive rows and
share that sentence's encoder output. `group_queries` puts their queries side
by side in one row, so that they attend to keys/values held once per sentence
(broadcast, never copied per beam); `ungroup` undoes it.

Given a `Packing`, the modules take and return the real tokens of a padded
batch as rows (N, D) (`transformer_mt.model.packing`): the projections run
on those rows only, and attention on their (B, T) layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer_mt.model.dropout import dropout as drop
from transformer_mt.model.packing import Packing


def split_heads(x: Tensor, parts: int, heads: int) -> tuple[Tensor, ...]:
    """(B, T, parts*D) -> `parts` views of shape (B, H, T, D/H), without copying."""
    B, T, _ = x.shape
    x = x.view(B, T, parts, heads, -1)  # (B, T, parts, H, Dh)
    return tuple(x.permute(2, 0, 3, 1, 4).unbind(0))  # parts x (B, H, T, Dh)


def split_parts(x: Tensor, heads: int, widths: tuple[int, ...]) -> tuple[Tensor, ...]:
    """(B, T, H*sum(widths)) -> one (B, H, T, w) view per width w of a stacked projection, without copying.

    Equal widths (the paper's d_k = d_v) take `split_heads`' single view; otherwise each part is sliced first.
    """
    if len(set(widths)) == 1:
        return split_heads(x, len(widths), heads)
    parts = x.split([heads * w for w in widths], dim=-1)
    return tuple(view for part in parts for view in split_heads(part, 1, heads))


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


SMALL_QUERIES = 8  # queries per row up to which `attention` uses plain matmuls (decoding steps)


def attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, is_causal: bool = False, dropout: float = 0.0,
    groups: int = 1,
) -> Tensor:  # fmt: skip
    """softmax(Q K^T / sqrt(d_k) + mask) V: q (B*G, H, T, Dh), k and v (B, H, S, Dh) -> (B*G, H, T, Dh).

    Each group of G consecutive query rows attends to one row of keys/values
    (`group_queries`). PyTorch's fused CPU kernel tiles long query blocks; for
    a few queries per row (a decoding step: the k beams of a sentence, one
    position each) two batched matmuls are faster on the CPU, and the same
    formula; so it is for bf16 training on the CPU (`_bf16_attention`). Elsewhere
    `scaled_dot_product_attention` picks its kernel.
    """
    q = group_queries(q, groups)
    if q.device.type == "cpu" and q.shape[2] <= SMALL_QUERIES and dropout == 0.0 and not is_causal:
        y = _matmul_attention(q, k, v, mask)
    elif q.device.type == "cpu" and q.dtype == torch.bfloat16:
        y = _bf16_attention(q, k, v, mask, is_causal, dropout)
    else:
        if mask is not None and mask.is_floating_point() and mask.dtype != q.dtype:
            mask = mask.to(q.dtype)  # a float mask must match the queries (bf16 under autocast); 0 and -inf stay exact
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal)
    return ungroup(y, groups)


def _matmul_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    return torch.matmul(torch.softmax(_scores(q, k, mask), dim=-1), v)  # (B, H, T, Dv)


def _bf16_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, dropout: float) -> Tensor:
    """The formula in bf16 matmuls with the softmax in fp32, for bf16 training on the CPU.

    Why not the fused kernel: its CPU backward in bf16 is about 5x slower than
    in fp32 and made bf16 training no faster than fp32; two bf16 batched
    matmuls and an fp32 softmax of the (B, H, T, S) scores cost far less at
    training lengths (tens of tokens) and keep the probabilities exact to fp32.
    """
    probs = torch.softmax(_scores(q, k, mask, is_causal), dim=-1, dtype=torch.float32).to(v.dtype)
    if dropout > 0.0:
        probs = drop(probs, dropout)
    return torch.matmul(probs, v)  # (B, H, T, Dv)


def _scores(q: Tensor, k: Tensor, mask: Tensor | None, is_causal: bool = False) -> Tensor:
    """Q K^T / sqrt(d_k) with the mask applied: (B, H, T, S), -inf where a query may not attend."""
    scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-1, -2))  # (B, H, T, S)
    if is_causal:  # as scaled_dot_product_attention: query i sees keys 0..i
        T, S = scores.shape[-2:]
        scores.masked_fill_(~torch.ones(T, S, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    if mask is not None and mask.dtype == torch.bool:
        scores.masked_fill_(~mask, float("-inf"))
    elif mask is not None:
        scores.add_(mask)
    return scores


def explicit_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, is_causal: bool = False, dropout: float = 0.0,
    groups: int = 1,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """`attention`'s output and the attention weights it never forms: ((B*G, H, T, Dv), (B*G, H, T, S)).

    The weights are probabilities over keys (each row sums to 1; exactly 0
    where the mask forbids), before attention dropout. Slower and heavier
    than the fused kernel: for inspecting a model, not for training it.
    """
    q = group_queries(q, groups)
    weights = torch.softmax(_scores(q, k, mask, is_causal), dim=-1)  # (B, H, G*T, S)
    dropped = F.dropout(weights, dropout) if dropout > 0.0 else weights
    return ungroup(torch.matmul(dropped, v), groups), ungroup(weights, groups)


def additive_mask(mask: Tensor | None) -> Tensor | None:
    """A boolean mask (True where a query may attend) as the float mask added to the scores: 0 or -inf.

    Built once and shared by every layer, instead of each layer converting the boolean mask again.
    """
    if mask is None:
        return None
    return torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf"))


def merge_heads(x: Tensor, packing: Packing | None = None) -> Tensor:
    """(B, H, T, Dh) -> (B, T, H*Dh); with a packing, (N, H*Dh) for its real positions."""
    if packing is not None:
        return packing.merge_heads(x)
    B, H, T, Dh = x.shape
    return x.transpose(1, 2).reshape(B, T, H * Dh)


def laid_out(x: Tensor, packing: Packing | None) -> Tensor:
    """A projection's output as (B, T, C): x itself, or x (N, C) unpacked by `packing`."""
    return x if packing is None else packing.unpack(x)


class SelfAttention(nn.Module):
    """Queries, keys and values all come from the same sequence."""

    def __init__(self, d_model: int, heads: int, attention_dropout: float, d_k: int = 0) -> None:
        super().__init__()
        self.heads = heads
        self.attention_dropout = attention_dropout
        self.d_k, self.d_v = head_dims(d_model, heads, d_k)
        self.qkv = nn.Linear(d_model, heads * (2 * self.d_k + self.d_v))  # W_Q, W_K, W_V stacked
        self.out = nn.Linear(d_model, d_model)  # W_O

    def project(self, x: Tensor, packing: Packing | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Per-head queries, keys and values of x (B, T, D) or packed (N, D): (B, H, T, d_k) x2 and (B, H, T, d_v)."""
        q, k, v = split_parts(laid_out(self.qkv(x), packing), self.heads, (self.d_k, self.d_k, self.d_v))
        return q, k, v

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, is_causal: bool = False, groups: int = 1,
        weights: list[Tensor] | None = None, packing: Packing | None = None,
    ) -> Tensor:  # fmt: skip
        """softmax(Q K^T / sqrt(d_k)) V for all heads, then W_O: (B, H, T, d_k|d_v) x3 -> (B, T, D), or (N, D)
        for the real positions of a packing.

        With ``groups`` G > 1, q holds B*G rows and k, v hold B rows: each
        group of G consecutive query rows attends to one row of keys/values.
        With a ``weights`` list, the explicit path appends the weights (B*G, H, T, S).
        """
        p = self.attention_dropout if self.training else 0.0
        if weights is None:
            y = attention(q, k, v, mask, is_causal, p, groups)
        else:
            y, probs = explicit_attention(q, k, v, mask, is_causal, p, groups)
            weights.append(probs)
        return self.out(merge_heads(y, packing))  # (B*G, T, D) or (N, D)

    def forward(
        self, x: Tensor, mask: Tensor | None = None, is_causal: bool = False, weights: list[Tensor] | None = None,
        packing: Packing | None = None,
    ) -> Tensor:  # fmt: skip
        """Attention of x (B, T, D), or packed (N, D), over itself; mask broadcasts to (B, H, T, T)."""
        q, k, v = self.project(x, packing)
        return self.attend(q, k, v, mask, is_causal, weights=weights, packing=packing)


class CrossAttention(nn.Module):
    """Decoder queries attend over the encoder output ("memory")."""

    def __init__(self, d_model: int, heads: int, attention_dropout: float, d_k: int = 0) -> None:
        super().__init__()
        self.heads = heads
        self.attention_dropout = attention_dropout
        self.d_k, self.d_v = head_dims(d_model, heads, d_k)
        self.q = nn.Linear(d_model, heads * self.d_k)  # W_Q
        self.kv = nn.Linear(d_model, heads * (self.d_k + self.d_v))  # W_K, W_V stacked
        self.out = nn.Linear(d_model, d_model)  # W_O

    def project_memory(self, memory: Tensor, packing: Packing | None = None) -> tuple[Tensor, Tensor]:
        """Per-head keys and values of the encoder output (B, S, D), or packed (N, D) with the source's
        packing: (B, H, S, d_k) and (B, H, S, d_v)."""
        k, v = split_parts(laid_out(self.kv(memory), packing), self.heads, (self.d_k, self.d_v))
        return k, v

    def forward(
        self, x: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, weights: list[Tensor] | None = None,
        packing: Packing | None = None,
    ) -> Tensor:  # fmt: skip
        """Attention of x (B*G, T, D) over memory keys/values (B, H, S, d_k|d_v); mask broadcasts to (B, H, G*T, S).

        G = x rows per memory row: 1 in training, the beam size in beam search,
        whose k beams of a sentence read its memory once instead of k copies.
        With a ``weights`` list, the explicit path appends the weights (B*G, H, T, S).
        With the target's ``packing``, x and the result are its real positions (N, D).
        """
        (q,) = split_heads(laid_out(self.q(x), packing), 1, self.heads)  # (B*G, H, T, d_k)
        groups = q.shape[0] // k.shape[0]
        p = self.attention_dropout if self.training else 0.0
        if weights is None:
            y = attention(q, k, v, mask, dropout=p, groups=groups)
        else:
            y, probs = explicit_attention(q, k, v, mask, dropout=p, groups=groups)
            weights.append(probs)
        return self.out(merge_heads(y, packing))  # (B*G, T, D) or (N, D)


def head_dims(d_model: int, heads: int, d_k: int = 0) -> tuple[int, int]:
    """(d_k, d_v) per head: d_v = d_model / h, as W_O maps h*d_v back to d_model; d_k = d_v unless given (row B)."""
    d_v = d_model // heads
    return (d_k or d_v), d_v
