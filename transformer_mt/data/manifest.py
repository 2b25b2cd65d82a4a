"""``manifest.json``, the record `tmt prepare` writes last into ``data.dir``: what it made, and from what.

Its presence means "complete and matching these inputs" (`prepare.is_prepared`).
`Manifest` is the one description of its layout; dictionaries exist only at the
JSON boundary (`Manifest.to_json`, `Manifest.from_dict`), and the JSON keeps
the key order it has always had, so that the same inputs write the same bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class MalformedManifest(ValueError):
    """The file is JSON but not a manifest this layout reads: `prepare.load_manifest` takes it as absent."""


@dataclass(frozen=True)
class InputFile:
    """An input text file as prepare read it; a file whose size and mtime are unchanged keeps its hash."""

    sha256: str
    lines: int
    size: int
    mtime_ns: int

    def to_dict(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "lines": self.lines, "size": self.size, "mtime_ns": self.mtime_ns}

    @classmethod
    def from_dict(cls, raw: Any) -> InputFile:
        return cls(
            sha256=_get(raw, "sha256", str),
            lines=_get(raw, "lines", int),
            size=_get(raw, "size", int),
            mtime_ns=_get(raw, "mtime_ns", int),
        )


@dataclass
class SplitStats:
    """One split's counts: pairs read, kept (``sentences``) and dropped per reason, then its BPE tokens per side."""

    read: int
    sentences: int
    dropped: dict[str, int]
    bpe_sample: int | None = None  # sentences sampled for learning BPE: train only, and only when BPE is learned
    src_tokens: int = 0
    tgt_tokens: int = 0
    src_unk: int = 0  # absent from manifests written before <unk> was counted
    tgt_unk: int = 0

    def to_dict(self) -> dict[str, Any]:
        sample = {} if self.bpe_sample is None else {"bpe_sample": self.bpe_sample}
        return (
            {"read": self.read, "sentences": self.sentences, "dropped": dict(self.dropped)}
            | sample
            | {
                "src_tokens": self.src_tokens,
                "tgt_tokens": self.tgt_tokens,
                "src_unk": self.src_unk,
                "tgt_unk": self.tgt_unk,
            }
        )

    @classmethod
    def from_dict(cls, raw: Any) -> SplitStats:
        return cls(
            read=_get(raw, "read", int),
            sentences=_get(raw, "sentences", int),
            dropped=_get(raw, "dropped", dict),
            bpe_sample=_get(raw, "bpe_sample", int, None),
            src_tokens=_get(raw, "src_tokens", int),
            tgt_tokens=_get(raw, "tgt_tokens", int),
            src_unk=_get(raw, "src_unk", int, 0),
            tgt_unk=_get(raw, "tgt_unk", int, 0),
        )


@dataclass(frozen=True)
class GivenBpe:
    """The sentencepiece model ``bpe.model`` named, copied instead of learning one: its path and digest."""

    path: str
    sha256: str


@dataclass
class Manifest:
    """What one prepare wrote into ``data.dir`` (``files``), and the inputs and config it was made from."""

    format: int
    src_lang: str
    tgt_lang: str
    vocab_size: int
    ids_dtype: str  # numpy's name: uint16 when the vocabulary fits, else int32
    config_hash: str  # `prepare.prepare_hash`: the data and bpe keys that change the output
    config: dict[str, Any]  # {"data": ..., "bpe": ...} as given, for reading
    inputs: dict[str, InputFile]  # by path, as the config spells it
    splits: dict[
        str, SplitStats
    ]  # train, valid and test (when there is one), in that order; per direction: train.en-de
    files: list[str]  # names in data.dir
    seconds: dict[str, float]  # per step: clean, bpe, encode
    workers: int
    bpe_model: GivenBpe | None = None  # set with bpe.model; None when the BPE model was learned
    directions: list[str] = field(
        default_factory=list
    )  # every direction (data.directions, data.corpora); [] for one pair

    def to_dict(self) -> dict[str, Any]:
        given = (
            {}
            if self.bpe_model is None
            else {"bpe_model": {"path": self.bpe_model.path, "sha256": self.bpe_model.sha256}}
        )
        return (
            given
            | {
                "format": self.format,
                "src_lang": self.src_lang,
                "tgt_lang": self.tgt_lang,
                "vocab_size": self.vocab_size,
                "ids_dtype": self.ids_dtype,
                "config_hash": self.config_hash,
                "config": self.config,
                "inputs": {path: f.to_dict() for path, f in self.inputs.items()},
                "splits": {name: s.to_dict() for name, s in self.splits.items()},
                "files": list(self.files),
                "seconds": dict(self.seconds),
                "workers": self.workers,
            }
            | ({"directions": list(self.directions)} if self.directions else {})
        )

    def to_json(self) -> str:
        """The text of ``manifest.json``."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, raw: Any) -> Manifest:
        """The manifest a parsed ``manifest.json`` holds; `MalformedManifest` when it holds none of this layout.

        ``format`` is read whatever its value: a manifest of another format is
        one that is not up to date (`prepare._up_to_date`), not a broken one.
        """
        given = _get(raw, "bpe_model", dict, None)
        return cls(
            format=_get(raw, "format", int),
            src_lang=_get(raw, "src_lang", str),
            tgt_lang=_get(raw, "tgt_lang", str),
            vocab_size=_get(raw, "vocab_size", int),
            ids_dtype=_get(raw, "ids_dtype", str),
            config_hash=_get(raw, "config_hash", str),
            config=_get(raw, "config", dict),
            inputs={path: InputFile.from_dict(f) for path, f in _get(raw, "inputs", dict).items()},
            splits={name: SplitStats.from_dict(s) for name, s in _get(raw, "splits", dict).items()},
            files=_get(raw, "files", list),
            seconds=_get(raw, "seconds", dict),
            workers=_get(raw, "workers", int),
            bpe_model=None if given is None else GivenBpe(_get(given, "path", str), _get(given, "sha256", str)),
            directions=_get(raw, "directions", list, []),
        )


_REQUIRED = object()


def _get(raw: Any, key: str, kind: type, default: Any = _REQUIRED) -> Any:
    """``raw[key]`` when ``raw`` is a dict holding a ``kind`` there; ``default`` when absent, if one is given."""
    if not isinstance(raw, dict):
        raise MalformedManifest(f"expected an object holding {key!r}, found {type(raw).__name__}")
    if key not in raw and default is not _REQUIRED:
        return default
    value = raw.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise MalformedManifest(f"{key!r}: expected {kind.__name__}, found {type(value).__name__}")
    return value
