"""A word aligner trained for one model: links read from its frozen states, learned from a word aligner's links.

The attention of a small translation model is a weak aligner: on Multi30k
it put 65-71% of HTML tags around exactly the right words
(benchmarks/README.md, "HTML tag placement"), because a decoder step
attends to what it needs to predict the next token, not to what the
current one translates. Garg et al. (2019) supervise one attention head
with the links of a statistical aligner instead. This is the same
supervision on a small head of its own, trained after the model with the
model frozen (`tmt train-aligner`, `transformer_mt.train.aligner`), so that
it changes no translation and trains in minutes on a CPU:

- a target token is read from the decoder's top output at the step that
  predicted it and at the step that read it, and from its own embedding,
  through one bidirectional self-attention layer (the decoder sees only
  the tokens before; a link often depends on the words after);
- a source token from the encoder's output and its own embedding;
- each side's token vectors are averaged over each word's tokens, and a
  (target word, source word) pair is a link with probability
  sigmoid(q . k / sqrt(dim) + weighted log-attention of the model's top
  layer over the pair + a bias): the model's attention is one input, not
  the answer. Words, not tokens, as the links it learns from count them:
  a final "." piece must not link "dog." to "Hund.".

It learns from the links of an aligner such as eflomal or fast_align
(Pharaoh ``i-j`` lines over the text's whitespace words) with binary
cross-entropy over every word pair. ``--alignment soft`` gives the link
probabilities, ``hard`` the pairs at ``decode.aligner_threshold`` or above
(a word may have several links or none, as the supervising aligner's).
The head's weights travel in the checkpoint (its ``aligner`` entry) and are
used whenever they are there (``decode.use_aligner``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import sentencepiece as spm
import torch
from torch import Tensor, nn

from transformer_mt.data.bpe import BOS, PAD
from transformer_mt.decode.align import format_pharaoh, text_span, word_index
from transformer_mt.decode.search import pad_batch
from transformer_mt.model.transformer import AttentionMaps, Transformer


@dataclass(frozen=True)
class AlignerShape:
    """The head's size, stored beside its weights (a checkpoint's ``aligner.shape``)."""

    dim: int = 256  # the width of the head's token vectors
    heads: int = 4  # of its target-side self-attention layer
    layers: int = 1  # target-side self-attention layers (0: none, the decoder's left context alone)

    @classmethod
    def of(cls, entry: dict[str, Any]) -> AlignerShape:
        return cls(**{k: int(entry[k]) for k in ("dim", "heads", "layers") if k in entry})


class Aligner(nn.Module):
    """Link logits (B, target words, source words) from a frozen `Transformer`'s `States`."""

    def __init__(self, d_model: int, shape: AlignerShape) -> None:
        super().__init__()
        self.shape = shape
        self.source = nn.Linear(2 * d_model, shape.dim)
        self.target = nn.Linear(3 * d_model, shape.dim)
        layer = nn.TransformerEncoderLayer(
            shape.dim, shape.heads, 2 * shape.dim, dropout=0.1, batch_first=True, norm_first=True
        )
        self.context = nn.ModuleList(copy.deepcopy(layer) for _ in range(shape.layers))
        self.query = nn.Linear(shape.dim, shape.dim)
        self.key = nn.Linear(shape.dim, shape.dim)
        self.prior = nn.Parameter(torch.tensor([1.0, 0.0]))  # weights of log-attention: predicting, reading step
        self.bias = nn.Parameter(torch.tensor(-2.0))

    def forward(self, states: States) -> Tensor:
        """Logits (B, Wt, Ws) of each target word being linked to each source word: token vectors averaged over
        each word's tokens, so that a word is judged whole (a final "." piece does not link "dog." to "Hund.")."""
        tgt = self.target(torch.cat([states.decoder[:, :-1], states.decoder[:, 1:], states.tgt_embed], dim=-1))
        for layer in self.context:
            tgt = layer(tgt, src_key_padding_mask=states.tgt_pad)
        src = self.source(torch.cat([states.encoder, states.src_embed], dim=-1))
        q, k = states.tgt_pool @ self.query(tgt), states.src_pool @ self.key(src)
        logits = q @ k.transpose(1, 2) / math.sqrt(self.shape.dim)
        summed = (states.src_pool > 0).float().transpose(1, 2)  # (B, S, Ws): a word's attention is its tokens' sum
        for weight, steps in zip(self.prior, (states.attention[:, :-1], states.attention[:, 1:]), strict=True):
            logits = logits + weight * (states.tgt_pool @ steps @ summed).clamp_min(1e-6).log()
        return logits + self.bias


@dataclass
class States:
    """What the aligner reads of a teacher-forced pass over (source, BOS + target): the encoder's output (B, S, D),
    the decoder's top output at each step (B, T + 1, D), the top layer's cross-attention averaged over its heads
    (B, T + 1, S), the target's padding (B, T), each token's own embedding, source (B, S, D) and target (B, T, D)
    (what a word is, beside what its context made of it), and the word pools, (B, Ws, S) and (B, Wt, T): row w
    averages the tokens of word w (EOS, a target tag and padding belong to no word)."""

    encoder: Tensor
    decoder: Tensor
    attention: Tensor
    tgt_pad: Tensor
    src_embed: Tensor
    tgt_embed: Tensor
    src_pool: Tensor
    tgt_pool: Tensor


@torch.no_grad()
def model_states(
    model: Transformer,
    bpe: spm.SentencePieceProcessor,
    sources: Sequence[Sequence[int]],
    targets: Sequence[Sequence[int]],
    skip: int = 0,
) -> States:
    """The `States` of ``model`` (frozen, eval mode) for (source ids + EOS, target ids) pairs, whose source starts
    with ``skip`` tag ids; the decoder reads BOS + the target, so step t predicts token t and step t + 1 reads it."""
    device = model.embed.weight.device
    src, tgt = pad_batch(sources).to(device), pad_batch(targets).to(device)
    tgt_in = torch.cat([torch.full_like(tgt[:, :1], BOS), tgt], dim=1)
    enc = model.encode(src)
    maps = AttentionMaps()
    decoder = model.decode_features(tgt_in, enc, maps=maps)
    attention = maps.cross[-1].float().mean(dim=1)
    src_table = model.embed if model.src_embed is None else model.src_embed
    embedded = (src_table(src).float(), model.embed(tgt).float())
    spans = [text_span(s, skip) for s in sources]
    pools = (
        word_pool(bpe, [s[a:b] for s, (a, b) in zip(sources, spans, strict=True)], [a for a, _ in spans], src.shape[1]),
        word_pool(bpe, targets, [0] * len(targets), tgt.shape[1]),
    )
    return States(
        enc.memory.float(), decoder.float(), attention, tgt.eq(PAD), *embedded, *(p.to(device) for p in pools)
    )


def word_pool(
    bpe: spm.SentencePieceProcessor, rows: Sequence[Sequence[int]], starts: Sequence[int], width: int
) -> Tensor:
    """(B, most words, ``width``): row w of sentence b averages the tokens of its word w, which begin at
    ``starts[b]`` of its ids."""
    words = [word_index([bpe.id_to_piece(t) for t in row]) for row in rows]
    pool = torch.zeros(len(rows), max((w[-1] + 1 for w in words if w), default=1), width)
    for b, (index, start) in enumerate(zip(words, starts, strict=True)):
        for t, w in enumerate(index):
            pool[b, w, start + t] = 1.0
    return pool / pool.sum(dim=2, keepdim=True).clamp_min(1.0)


@torch.no_grad()
def link_probabilities(
    model: Transformer,
    aligner: Aligner,
    bpe: spm.SentencePieceProcessor,
    sources: Sequence[Sequence[int]],
    targets: Sequence[Sequence[int]],
    skip: int,
) -> list[Tensor]:
    """Per (source ids + EOS, target ids) pair, the aligner's link probabilities (target words, source words of the
    text: EOS and the first ``skip`` ids, a target tag, are no words)."""
    states = model_states(model, bpe, sources, targets, skip)
    probs = aligner(states).sigmoid().cpu()
    n_src = (states.src_pool.sum(dim=2) > 0).sum(dim=1).tolist()
    n_tgt = (states.tgt_pool.sum(dim=2) > 0).sum(dim=1).tolist()
    return [probs[b, : n_tgt[b], : n_src[b]] for b in range(len(sources))]


def format_links(matrix: Tensor, kind: Literal["hard", "soft"], threshold: float) -> str:
    """``matrix`` (target words, source words) of link probabilities as a Pharaoh ``i-j`` line of the pairs at
    ``threshold`` or above (``hard``), or as the probabilities, ``p,p,p`` per target word (``soft``)."""
    if kind == "soft":
        return " ".join(",".join(f"{p:.2f}" for p in row) for row in matrix.tolist())
    return format_pharaoh((i, j) for j, i in (matrix >= threshold).nonzero().tolist())


def aligner_alignments(
    model: Transformer,
    aligner: Aligner,
    bpe: spm.SentencePieceProcessor,
    sources: Sequence[Sequence[int]],
    targets: Sequence[Sequence[int]],
    kind: Literal["hard", "soft"],
    threshold: float,
    skip: int = 0,
) -> list[str]:
    """The alignment line of each (source ids + EOS, target ids) pair by ``aligner``; "" where either side is
    empty (as `transformer_mt.decode.align.alignments` gives the attention's)."""
    todo = [i for i, (s, t) in enumerate(zip(sources, targets, strict=True)) if t and len(s) > 1 + skip]
    lines = [""] * len(targets)
    if todo:
        found = link_probabilities(model, aligner, bpe, [sources[i] for i in todo], [targets[i] for i in todo], skip)
        for i, probs in zip(todo, found, strict=True):
            lines[i] = format_links(probs, kind, threshold)
    return lines


def to_entry(aligner: Aligner, figures: dict[str, float]) -> dict[str, Any]:
    """The checkpoint's ``aligner`` entry: weights, shape and the validation figures it was kept for."""
    state = {k: v.detach().cpu().contiguous() for k, v in aligner.state_dict().items()}
    return {"weights": state, "shape": asdict(aligner.shape), "valid": dict(figures)}


def from_entry(entry: dict[str, Any], d_model: int) -> Aligner:
    """The `Aligner` of a checkpoint's ``aligner`` entry (checked when the checkpoint was read)."""
    aligner = Aligner(d_model, AlignerShape.of(entry["shape"]))
    aligner.load_state_dict(entry["weights"])
    return aligner.eval()
