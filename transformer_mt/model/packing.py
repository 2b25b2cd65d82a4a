"""A padded batch's real tokens as rows of their own, for the layers that act on each position alone.

Why: a right-padded (B, T) batch spends its projections, feed-forward
layers, LayerNorms, dropout and the output projection on padding too; in
length-bucketed batches that is 2-9% of the positions. Only attention needs
the (B, T) layout. Training on the CPU keeps the residual stream as (N, D),
the N real tokens in row-major order, lays each attention's queries, keys and
values out as (B, T, C) (zeros at padding, which the masks never let a real
position see) and packs the attention's output again before W_O. The model
is the same function: every real position gets what it gets unpacked.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class Packing:
    """Where the real tokens of a right-padded (B, T) batch sit."""

    index: Tensor  # (N,) flat position b * T + t of each real token, ascending
    cols: Tensor  # (N,) its position t in its row
    shape: tuple[int, int]  # (B, T)

    @classmethod
    def of(cls, pad_mask: Tensor) -> Packing:
        """From a (B, T) mask, True at padding."""
        index = (~pad_mask).flatten().nonzero().squeeze(1)
        return cls(index, index % pad_mask.shape[1], (pad_mask.shape[0], pad_mask.shape[1]))

    def pack(self, x: Tensor) -> Tensor:
        """(B, T, ...) -> (N, ...): the real positions' rows."""
        return x.flatten(0, 1).index_select(0, self.index)

    def unpack(self, x: Tensor) -> Tensor:
        """(N, C) -> (B, T, C), zeros at padding."""
        out = x.new_zeros(self.shape[0] * self.shape[1], x.shape[-1])
        out[self.index] = x
        return out.view(*self.shape, x.shape[-1])

    def merge_heads(self, y: Tensor) -> Tensor:
        """Attention output (B, H, T, Dh) -> (N, H*Dh), the real positions with their heads side by side."""
        return self.pack(y.transpose(1, 2).flatten(2))
