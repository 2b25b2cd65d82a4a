"""The one naming convention of raw parallel text: a split's file per language is ``{prefix}.{lang}``.

``data.train: corpus/train`` with ``data.src_lang: en`` reads ``corpus/train.en``;
`tmt download`, `tmt synth`, `tmt init` and `tmt prepare` all name files this way.
"""

from __future__ import annotations

from pathlib import Path


def raw_file(prefix: str | Path, lang: str) -> Path:
    """The text file of ``lang`` for the split ``prefix`` (a path without the language): ``{prefix}.{lang}``."""
    return Path(f"{prefix}.{lang}")
