"""Position information added to the token embeddings (paper section 3.5).

The paper's sinusoids interleave sine and cosine: even dimensions 2i hold
sin(pos / 10000^(2i/d_model)) and odd dimensions 2i+1 hold the cosine of the
same angle. (tensor2tensor and fairseq concatenate [sin..., cos...] instead;
the two layouts are a fixed permutation of each other, but checkpoints and
tests here follow the paper.) Learned positions are the paper's Table 3 row E.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from transformer_mt.errors import UserError


class PositionError(UserError):
    """A sequence longer than the position table; the message names model.max_positions and the fixes."""


def sinusoidal_positions(length: int, d_model: int) -> Tensor:
    """The paper's positional encodings for positions 0 .. length-1, shape (length, d_model), float32.

    PE(pos, 2i)   = sin(pos / 10000^(2i / d_model))
    PE(pos, 2i+1) = cos(pos / 10000^(2i / d_model))

    Computed in float64 so that large positions keep full float32 accuracy.
    """
    pos = torch.arange(length, dtype=torch.float64)[:, None]  # (L, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (ceil(D/2),)
    angle = pos / torch.pow(10000.0, two_i / d_model)  # (L, ceil(D/2)), radians
    pe = torch.empty(length, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle[:, : d_model // 2])
    return pe.float()


def take(table: Tensor, length: int, offset: int | Tensor) -> Tensor:
    """Rows offset .. offset+length-1 of a position ``table``: (length, D); with one offset per sequence
    (``offset`` a LongTensor (B,), sentences that joined a running search at different steps), (B, length, D)."""
    if isinstance(offset, Tensor):
        check_length(int(offset.max()) + length, table.shape[0])
        return table[offset[:, None] + torch.arange(length, device=offset.device)]
    check_length(offset + length, table.shape[0])
    return table[offset : offset + length]


def check_length(end: int, max_positions: int) -> None:
    """Refuse positions past the table: a clear error instead of an index error deep inside."""
    if end > max_positions:
        raise PositionError(
            f"sequence needs {end} positions but model.max_positions is {max_positions}; "
            f"shorten or filter the input (data.max_len, decode.max_len_a/max_len_b) or raise "
            f"model.max_positions (sinusoidal positions can be raised for a trained checkpoint with "
            f"--set model.max_positions=N; learned positions cannot)"
        )


class SinusoidalPositions(nn.Module):
    """A fixed table of the paper's sinusoids; not saved in checkpoints, so max_positions can change."""

    def __init__(self, max_positions: int, d_model: int) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.register_buffer("table", sinusoidal_positions(max_positions, d_model), persistent=False)

    def forward(self, length: int, offset: int | Tensor = 0) -> Tensor:
        """Encodings of positions offset .. offset+length-1, shape (length, D); per-sequence offsets: `take`."""
        return take(self.table, length, offset)


class LearnedPositions(nn.Module):
    """One trained vector per position (Table 3 row E); initialized like the token embeddings."""

    def __init__(self, max_positions: int, d_model: int) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.weight = nn.Parameter(torch.empty(max_positions, d_model))
        nn.init.normal_(self.weight, mean=0.0, std=d_model**-0.5)

    def forward(self, length: int, offset: int | Tensor = 0) -> Tensor:
        """Vectors of positions offset .. offset+length-1, shape (length, D); per-sequence offsets: `take`."""
        return take(self.weight, length, offset)
