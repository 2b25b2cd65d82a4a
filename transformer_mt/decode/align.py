"""Word alignments of translations from the decoder's attention over the source (``tmt translate --alignment``).

A translation's alignment is read from a second, teacher-forced pass: the
model's decoder runs once over the chosen hypothesis (BOS + its tokens) with
the source, and the attention weights over the source of one decoder layer
(``decode.alignment_layer``; 0, the default: the top layer, which aligned
best on Multi30k, docs/decoding.md; fairseq takes the one below it) are
averaged over the heads. Reading them during the search would need them kept per beam
through every reorder of the cache; the second pass gives the attention of
exactly the hypothesis chosen, and costs one decoder pass.

Target token t is aligned by the attention of the step that predicted it
(query position t, which reads the tokens before t), fairseq's convention;
the EOS row and the source's EOS column are dropped, and each row is
renormalized over the real source tokens. Sentencepiece pieces become words
at the ``▁`` that starts each word. A word's weights: the mean over its
target pieces of the sum over its source pieces (`word_matrix`).

- ``soft``: per target word, the probabilities of the source words,
  ``p,p,p`` (two decimals) per target word, target words separated by spaces.
- ``hard``: per target word, its most probable source word, as Pharaoh
  ``i-j`` pairs (0-based source word i, target word j), sorted, separated by
  spaces: fast_align's and fairseq's output format.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import sentencepiece as spm
import torch
from torch import Tensor

from transformer_mt.data.bpe import BOS, EOS, PAD
from transformer_mt.model.transformer import Transformer

WORD_START = "\u2581"  # sentencepiece's mark of a piece that begins a word


def word_index(pieces: Sequence[str]) -> list[int]:
    """The 0-based word of each piece: a piece starting with ``▁`` starts a new word (so does the first piece)."""
    words, current = [], -1
    for i, piece in enumerate(pieces):
        if i == 0 or piece.startswith(WORD_START):
            current += 1
        words.append(current)
    return words


def word_matrix(attention: Tensor, src_words: Sequence[int], tgt_words: Sequence[int]) -> Tensor:
    """(target words, source words) from piece attention (target pieces, source pieces), rows summing to 1:
    summed over each source word's pieces, averaged over each target word's pieces."""
    n_src, n_tgt = max(src_words) + 1, max(tgt_words) + 1
    by_src = attention.new_zeros(attention.shape[0], n_src).index_add_(1, torch.tensor(src_words), attention)
    summed = by_src.new_zeros(n_tgt, n_src).index_add_(0, torch.tensor(tgt_words), by_src)
    counts = torch.bincount(torch.tensor(tgt_words), minlength=n_tgt).to(summed.dtype)
    return summed / counts[:, None]


def format_pharaoh(pairs: Iterable[tuple[int, int]]) -> str:
    """(source word, target word) pairs as a Pharaoh line: ``i-j`` sorted, separated by spaces."""
    return " ".join(f"{i}-{j}" for i, j in sorted(pairs))


def parse_pharaoh(line: str) -> set[tuple[int, int]]:
    """The (source word, target word) pairs of a well-formed Pharaoh line."""
    return {(int(i), int(j)) for i, j in (pair.split("-") for pair in line.split())}


def text_span(source: Sequence[int], skip: int) -> tuple[int, int]:
    """Where the text's tokens are in source ids: after ``skip`` tag ids, before EOS."""
    return skip, len(source) - 1 if source and source[-1] == EOS else len(source)


def format_alignment(matrix: Tensor, kind: Literal["hard", "soft"]) -> str:
    """``matrix`` (target words, source words) as a Pharaoh ``i-j`` line (``hard``) or probabilities (``soft``)."""
    if kind == "hard":
        return format_pharaoh((i, j) for j, i in enumerate(matrix.argmax(dim=1).tolist()))
    return " ".join(",".join(f"{p:.2f}" for p in row) for row in matrix.tolist())


@torch.no_grad()
def piece_attention(model: Transformer, sources: Sequence[Sequence[int]], targets: Sequence[Sequence[int]],
                    layer: int, skip: int = 0) -> list[Tensor]:  # fmt: skip
    """Per (source ids + EOS, target ids) pair, one layer's (1-based) decoder attention over the source, mean over
    the heads: (target tokens, source tokens without EOS and without the first ``skip``, a target tag), rows
    renormalized. One batched teacher-forced pass."""
    device = model.embed.weight.device
    src = torch.full((len(sources), max(map(len, sources))), PAD, dtype=torch.long)
    tgt = torch.full((len(targets), max(map(len, targets)) + 1), PAD, dtype=torch.long)
    for row, (s, t) in enumerate(zip(sources, targets, strict=True)):
        src[row, : len(s)] = torch.tensor(s)
        tgt[row, : len(t) + 1] = torch.tensor([BOS, *t])
    _, maps = model.forward_with_attention(src.to(device), tgt.to(device))
    weights = maps.cross[layer - 1].float().mean(dim=1).cpu()  # (B, T+1, S)
    found = []
    for row, (s, t) in enumerate(zip(sources, targets, strict=True)):
        start, end = text_span(s, skip)
        w = weights[row, : len(t), start:end]  # the steps that predicted the target tokens; the text's source tokens
        found.append(w / w.sum(dim=1, keepdim=True).clamp_min(1e-12))
    return found


def alignments(
    model: Transformer,
    bpe: spm.SentencePieceProcessor,
    sources: Sequence[Sequence[int]],
    targets: Sequence[Sequence[int]],
    layer: int,
    kind: Literal["hard", "soft"],
    skip: int = 0,
) -> list[str]:
    """The alignment line of each (source ids + EOS, target ids) pair; "" where either side is empty. The first
    ``skip`` source ids (a model of several directions' target tag) are no word of the text."""
    todo = [i for i, (s, t) in enumerate(zip(sources, targets, strict=True)) if t and len(s) > 1 + skip]
    lines = [""] * len(targets)
    if not todo:
        return lines
    found = piece_attention(model, [sources[i] for i in todo], [targets[i] for i in todo], layer, skip)
    for i, attention in zip(todo, found, strict=True):
        src_words = word_index([bpe.id_to_piece(t) for t in sources[i][skip : skip + attention.shape[1]]])
        tgt_words = word_index([bpe.id_to_piece(t) for t in targets[i]])
        lines[i] = format_alignment(word_matrix(attention, src_words, tgt_words), kind)
    return lines
