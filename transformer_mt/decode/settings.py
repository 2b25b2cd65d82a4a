"""The settings every search reads, built once from a config: beam, length penalty, maximum length, the rules.

`SearchSettings` is what `transformer_mt.decode.search` and its steps take
in place of a dozen keyword arguments each; `SearchSettings.of` reads it
from ``cfg.decode`` (and the model's position table), so a search and the
config cannot disagree about a default. The length formulas the settings
name (the penalty, the longest output) live here too: the searches, the
prefix and constraint checks and the engines all measure with them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from transformer_mt.config import Config, PenaltyForm, Sampling, Stopping, parse_sampling
from transformer_mt.data.bpe import PAD


@dataclass(frozen=True)
class SearchSettings:
    """How a search runs; the defaults are the paper's (beam 4, alpha 0.6, source length + 50).

    ``max_positions``: the decoder's position table, which caps the output
    (None: no cap). ``sampling``: draw tokens instead of searching
    (`transformer_mt.decode.sample`), with ``temperature`` and ``seed``.
    """

    beam_size: int = 4
    len_penalty: float = 0.6
    len_penalty_form: PenaltyForm = "gnmt"
    max_len_a: float = 1.0
    max_len_b: int = 50
    max_positions: int | None = None
    no_repeat_ngram: int = 0
    stopping: Stopping = "exact"
    sampling: Sampling | None = None
    temperature: float = 1.0
    seed: int = 1

    def __post_init__(self) -> None:
        if self.beam_size < 1:
            raise ValueError(f"beam_size must be at least 1, got {self.beam_size}")

    @classmethod
    def of(cls, cfg: Config) -> SearchSettings:
        """The settings of ``cfg.decode``, capped by ``cfg.model.max_positions``."""
        d = cfg.decode
        return cls(
            d.beam_size, d.len_penalty, d.len_penalty_form, d.max_len_a, d.max_len_b, cfg.model.max_positions,
            d.no_repeat_ngram, d.stopping, parse_sampling(d.sampling), d.sampling_temperature, d.seed,
        )  # fmt: skip

    def replace(self, **changes: Any) -> SearchSettings:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)

    def penalty(self, length: float | Tensor) -> Any:
        """`length_penalty` of ``length`` tokens (EOS included) with these settings."""
        return length_penalty(length, self.len_penalty, self.len_penalty_form)

    def max_lengths(self, src: Tensor) -> Tensor:
        """`max_output_lengths` of the sources ``src`` (B, S) with these settings."""
        return max_output_lengths(src, self.max_len_a, self.max_len_b, self.max_positions)


PAPER = SearchSettings()
"""The paper's decoding: beam 4, alpha 0.6 (gnmt form), up to source length + 50 tokens, exact early stopping."""


def length_penalty(length: float | Tensor, alpha: float, form: PenaltyForm = "gnmt") -> Any:
    """The divisor of a hypothesis' log-probability; ``length`` in tokens, EOS included.

    gnmt (Wu et al., 2016, the form the paper used with alpha 0.6):
    ``((5 + length) / 6) ** alpha``; fairseq: ``length ** alpha``. Both are 1
    when alpha is 0 (plain log-probability) and grow with length when alpha > 0.
    """
    if form == "gnmt":
        return ((5.0 + length) / 6.0) ** alpha
    if form == "fairseq":
        return length**alpha
    raise ValueError(f"unknown length penalty form {form!r}; use 'gnmt' or 'fairseq'")


def max_output_lengths(
    src: Tensor, max_len_a: float, max_len_b: int, max_positions: int | None = None, pad_id: int = PAD
) -> Tensor:
    """Most tokens (before EOS) each sentence may generate: ``a * src_len + b``, capped by positions.

    ``src`` (B, S) holds the source ids plus EOS, right-padded; ``src_len``
    excludes EOS. The decoder reads BOS plus the generated tokens, so the cap
    is ``max_positions - 1``. Returns a LongTensor (B,), at least 1.
    """
    src_len = (src.ne(pad_id).sum(dim=1) - 1).clamp(min=0).to(torch.float64)  # (B,)
    max_len = torch.floor(max_len_a * src_len + max_len_b).long()
    if max_positions is not None:
        max_len = max_len.clamp(max=max_positions - 1)
    return max_len.clamp(min=1)
