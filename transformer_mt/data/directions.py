"""The translation directions of one model: a single pair, or several languages with a target token.

A model of several directions (``data.directions``, ``data.corpora``) reads, at the start of
each source, one token naming the language to translate into, ``<2de>``
(Johnson et al. 2017: the target tag on the encoder side, which Wu et al.
2021 found the most robust for directions never trained). The tags are
user-defined symbols of the joint BPE model, so they are single ids that no
text splits. A model of one pair (the default, the paper's) has no tag: its
data, checkpoints and outputs are those of before directions existed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import sentencepiece as spm

from transformer_mt.config import CorpusConfig, DataConfig
from transformer_mt.errors import UserError


class DirectionError(UserError):
    """A language or direction the model does not know; the message lists the ones it does."""


@dataclass(frozen=True)
class Direction:
    """One translation direction: source and target language codes (the files' suffixes)."""

    src: str
    tgt: str

    @property
    def name(self) -> str:
        """``en-de``: how configs, logs and metrics spell it."""
        return f"{self.src}-{self.tgt}"

    @classmethod
    def parse(cls, text: str) -> Direction:
        """``en-de`` as a Direction (the config has checked the form)."""
        src, _, tgt = text.partition("-")
        return cls(src, tgt)


def tag(lang: str) -> str:
    """The token that asks for a translation into ``lang``."""
    return f"<2{lang}>"


def directions(data: DataConfig) -> list[Direction]:
    """The directions a config trains, in its order: ``data.directions``, then ``data.corpora``'s (synthetic ones
    aside: they add pairs to a direction); or the one pair src_lang -> tgt_lang."""
    if not multilingual(data):
        return [Direction(data.src_lang, data.tgt_lang)]
    return [Direction.parse(text) for text in [*data.directions, *(c.direction for c in _real(data))]]


def multilingual(data: DataConfig) -> bool:
    """Whether the config lists directions (each source then starts with a target tag)."""
    return bool(data.directions or _real(data))


def _real(data: DataConfig) -> list[CorpusConfig]:
    return [c for c in data.corpora if not c.synthetic]


BT_TAG = "<BT>"  # the first source token of a tagged synthetic corpus (Caswell et al. 2019)


@dataclass(frozen=True)
class TrainPart:
    """One set of training pairs as ``data.dir`` holds it: a direction's real pairs, or a synthetic corpus's."""

    name: str  # its split in data.dir: train, train.en-de, train.synthetic2
    direction: Direction
    prefix: str  # its raw files' prefix
    key: str  # the config key naming it
    weight: float
    synthetic: bool = False
    tagged: bool = False


def train_parts(data: DataConfig) -> list[TrainPart]:
    """The training pairs, in the order they are laid end to end: each direction's, then each synthetic corpus's."""
    real = [
        TrainPart(split_name("train", data, way), way, prefix(data, way, "train"), prefix_key(data, way, "train"), w)
        for way, w in zip(directions(data), _direction_weights(data), strict=True)
    ]
    synthetic = [
        TrainPart(f"train.synthetic{i}", Direction.parse(c.direction), c.train, f"data.corpora[{i}].train", c.weight,
                  True, c.tag)
        for i, c in enumerate(data.corpora) if c.synthetic
    ]  # fmt: skip
    return real + synthetic


def mixed(data: DataConfig) -> bool:
    """Whether training draws from several parts (directions, synthetic corpora) rather than one prepared split."""
    return len(train_parts(data)) > 1 or multilingual(data)


def sources(data: DataConfig) -> list[str]:
    """The languages the model translates from, in the config's order."""
    return list(dict.fromkeys(way.src for way in directions(data)))


def targets(data: DataConfig) -> list[str]:
    """The languages the model translates into, in the config's order."""
    return list(dict.fromkeys(way.tgt for way in directions(data)))


def prefix(data: DataConfig, direction: Direction, split: str) -> str:
    """The prefix of ``direction``'s ``split`` (train, valid, test) files: its ``data.corpora`` entry's, or
    ``data.<split>`` (the multi-way parallel files, and an entry's empty valid or test); "" for none."""
    own = _own_entry(data, direction, split)
    return getattr(own[1] if own else data, split)


def prefix_key(data: DataConfig, direction: Direction, split: str) -> str:
    """The config key `prefix` read, for messages: ``data.corpora[1].valid`` or ``data.valid``."""
    own = _own_entry(data, direction, split)
    return f"data.corpora[{own[0]}].{split}" if own else f"data.{split}"


def _own_entry(data: DataConfig, direction: Direction, split: str) -> tuple[int, CorpusConfig] | None:
    """The real ``data.corpora`` entry (its index, itself) that names ``direction``'s ``split`` files, if one does."""
    named = (
        (i, c) for i, c in enumerate(data.corpora)
        if c.direction == direction.name and getattr(c, split) and not c.synthetic
    )  # fmt: skip
    return next(named, None)


def _direction_weights(data: DataConfig) -> list[float]:
    """Each direction's weight, in `directions` order: its real ``data.corpora`` entry's, else 1."""
    real = _real(data) if multilingual(data) else []
    return [1.0] * (len(directions(data)) - len(real)) + [c.weight for c in real]


def weights(data: DataConfig) -> list[float]:
    """Each training part's weight on its share of an epoch, in `train_parts` order."""
    return [part.weight for part in train_parts(data)]


def languages(data: DataConfig) -> list[str]:
    """Every language of the config's directions, sources and targets, in order of first appearance."""
    return list(dict.fromkeys(lang for d in directions(data) for lang in (d.src, d.tgt)))


def split_name(split: str, data: DataConfig, direction: Direction) -> str:
    """How ``data.dir`` names a split: train, valid, test; with data.directions one per direction: train.en-de."""
    return f"{split}.{direction.name}" if multilingual(data) else split


def tag_symbols(data: DataConfig) -> list[str]:
    """The tags the BPE model must hold as single pieces: one per target language ([] for one pair), and <BT>
    when a synthetic corpus is tagged."""
    tags = [tag(lang) for lang in targets(data)] if multilingual(data) else []
    return tags + ([BT_TAG] if any(c.tag for c in data.corpora) else [])


def source_prefix(data: DataConfig, bpe: spm.SentencePieceProcessor, tgt: str, tagged: bool = False) -> np.ndarray:
    """The ids each source into ``tgt`` starts with: its target tag (none for a model of one pair), then <BT> for
    the pairs of a tagged synthetic corpus (``tagged``)."""
    pieces = ([tag(tgt)] if multilingual(data) else []) + ([BT_TAG] if tagged else [])
    return np.array([_piece_id(bpe, piece) for piece in pieces], dtype=np.int64)


def _piece_id(bpe: spm.SentencePieceProcessor, piece: str) -> int:
    index = bpe.piece_to_id(piece)
    if bpe.id_to_piece(index) != piece:
        raise DirectionError(f"the BPE model holds no {piece} token; run `tmt prepare --force CONFIG`")
    return index


def choose(
    data: DataConfig, src: str | None, tgt: str | None, where: str = "--src-lang/--tgt-lang", any_source: bool = False
) -> Direction:
    """The direction a translation asks for, checked against the model's directions.

    A model of one pair needs neither language (given ones must match it); a
    model of several needs the target, and the source too when more than one
    source language translates into it. A pair of known languages that was
    never trained (zero-shot) is allowed: `zero_shot` says so. An unknown
    language is a DirectionError naming the ones the model has. ``any_source``:
    a source left open takes the first that translates into the target (the
    source's language does not change what the model reads: a server's
    ``source: auto``).
    """
    trained, froms, intos = directions(data), sources(data), targets(data)
    for given, known, side in ((src, froms, "source"), (tgt, intos, "target")):
        if given is not None and given not in known:
            raise DirectionError(
                f"{where}: {given!r} is not a {side} language of this model; it translates from {', '.join(froms)} "
                f"into {', '.join(intos)}"
            )
    if tgt is None:
        if len(intos) > 1:
            raise DirectionError(
                f"this model translates into {', '.join(intos)}: choose one with --tgt-lang "
                f"(its directions: {', '.join(d.name for d in trained)})"
            )
        tgt = intos[0]
    if src is None:
        into = [d.src for d in trained if d.tgt == tgt]
        if len(into) > 1 and not any_source:
            raise DirectionError(f"this model translates into {tgt} from {', '.join(into)}: say which with --src-lang")
        src = into[0] if into else froms[0]
    if src == tgt:
        raise DirectionError(f"{where}: source and target are both {src!r}; choose two different languages")
    return Direction(src, tgt)


def zero_shot(data: DataConfig, direction: Direction) -> bool:
    """Whether ``direction`` joins a source and a target the model knows but was never trained on together."""
    return direction not in directions(data)
