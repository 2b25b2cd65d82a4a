"""tmt's text normalization built into a sentencepiece model, for exports that run without tmt.

tmt normalizes every line before sentencepiece (`data.clean.normalize`: NFC,
control and invisible characters dropped, whitespace runs collapsed to one
space); the sentencepiece model it trains normalizes nothing. An exported
model whose users tokenize raw text with sentencepiece alone (the Hugging
Face tokenizer of `tmt export hf`, the ``spm.model`` of `tmt export
ctranslate2`) carries that normalization as the model's character map
(`normalizing_spm`), so that raw text gives the ids tmt feeds its model;
`check_normalization` verifies it on awkward text before an export is
written. Pieces, ids and scores are untouched.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import sentencepiece as spm

from transformer_mt.data.clean import DROPPED, normalize
from transformer_mt.errors import UserError
from transformer_mt.files import DISK_FULL, no_room_message


class NormalizerError(UserError):
    """The normalization cannot be built into the sentencepiece model; the message says why and what to do."""


def normalization_rules() -> dict[str, str]:
    """`data.clean.normalize` as character rewrites: NFC (each decomposed or non-NFC form to its NFC), the
    dropped control and invisible characters to nothing, every other whitespace character to a space.

    NFC is reproduced for each character and each character's full canonical
    decomposition, which covers text as keyboards and converters write it;
    a precomposed character followed by a further combining mark (which NFC
    reorders) is left as it is.
    """
    rules: dict[str, str] = {}
    for cp in range(1, sys.maxunicode + 1):  # U+0000 ends a key of sentencepiece's map; text never holds it
        if 0xD800 <= cp <= 0xDFFF:
            continue
        char = chr(cp)
        if DROPPED.fullmatch(char):
            rules[char] = ""
        elif char.isspace() and char != " ":
            rules[char] = " "
        elif (composed := unicodedata.normalize("NFC", char)) != char:
            rules[char] = composed
        if (decomposed := unicodedata.normalize("NFD", char)) != char and unicodedata.normalize(
            "NFC", decomposed
        ) == char:
            rules.setdefault(decomposed, char)
    return rules


def normalizing_spm(spm_model: bytes) -> bytes:
    """``spm_model`` with tmt's normalization (`normalization_rules`) as its normalizer, runs of spaces collapsed.

    sentencepiece compiles character rules only while training: a throwaway
    model is trained on two lines with the rules, and its compiled character
    map replaces the empty (identity) one of ``spm_model``. Pieces, ids and
    scores are untouched. Needs protobuf, sentencepiece's model format.
    """
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:
        raise NormalizerError(
            "exporting needs protobuf to edit the sentencepiece model: pip install protobuf (or the hf or ctranslate2 extra)"
        ) from None
    with tempfile.TemporaryDirectory() as tmp, _room_in(tmp):
        rules = Path(tmp) / "rules.tsv"
        rules.write_text(
            "".join(f"{_hex(src)}\t{_hex(dst)}\n" for src, dst in normalization_rules().items()), encoding="utf-8"
        )
        (Path(tmp) / "text.txt").write_text("normalization rules only\n" * 20, encoding="utf-8")
        _train_rules_model(Path(tmp), rules)
        compiled = sentencepiece_model_pb2.ModelProto()
        compiled.ParseFromString((Path(tmp) / "rules.model").read_bytes())
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(spm_model)
    spec = proto.normalizer_spec
    spec.name = "tmt_normalize"
    spec.precompiled_charsmap = compiled.normalizer_spec.precompiled_charsmap
    spec.remove_extra_whitespaces = True  # after the map turned every whitespace into a space: " ".join(split())
    return proto.SerializeToString()


@contextmanager
def _room_in(tmp: str) -> Iterator[None]:
    """A full temporary directory is one error naming it and $TMPDIR, which moves it: the output is not at fault."""
    try:
        yield
    except OSError as err:
        if err.errno not in DISK_FULL:
            raise
        raise NormalizerError(no_room_message(tmp, err, "set TMPDIR to a directory on a disk with room")) from None


def _train_rules_model(directory: Path, rules: Path) -> None:
    """A tiny model whose only use is its compiled character map; in a child process, which keeps
    sentencepiece's training log (printed by its C++ code, past Python's streams) off the user's terminal."""
    code = (
        "import sentencepiece as s, sys; d = sys.argv[1]; s.SentencePieceTrainer.train(input=d + '/text.txt', "
        "model_prefix=d + '/rules', vocab_size=20, model_type='char', normalization_rule_tsv=sys.argv[2], "
        "minloglevel=2)"
    )
    done = subprocess.run([sys.executable, "-c", code, str(directory), str(rules)], capture_output=True, text=True)
    if done.returncode != 0:
        raise NormalizerError(
            f"sentencepiece could not compile tmt's normalization rules: {done.stderr.strip()[-300:]}"
        )


def _hex(text: str) -> str:
    return " ".join(f"{ord(c):X}" for c in text)


AWKWARD_TEXT = [
    "  Two  spaces,\ta tab and\u00a0a no-break space ",
    "zero\u200bwidth, soft\u00adhyphen, word\u2060joiner, \ufeffbyte order mark, bell\x07 and escape\x1b",
    "decomposed: e\u0301te\u0301, A\u030a, u\u0308ber; composed: été, Å, über; Angstrom sign \u212b",
    "line\u2028separator, ideographic\u3000space, thin\u2009space, em\u2003space",
    "",
    " \t ",
]


def check_normalization(normalizing: bytes, spm_model: bytes) -> None:
    """Refuse the export unless the normalizing model encodes `AWKWARD_TEXT` as tmt does (normalize, then
    encode); tests check real text too."""
    exported = spm.SentencePieceProcessor(model_proto=normalizing)
    original = spm.SentencePieceProcessor(model_proto=spm_model)
    for line in AWKWARD_TEXT:
        ours = original.encode(normalize(line), out_type=int)
        if exported.encode(line, out_type=int) != ours:
            raise NormalizerError(
                f"the exported tokenizer would encode {line[:60]!r} otherwise than tmt does (sentencepiece's "
                "character map cannot express tmt's normalization of it); report it, and translate with tmt"
            )
