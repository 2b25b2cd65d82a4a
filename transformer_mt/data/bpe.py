"""The joint sentencepiece BPE vocabulary shared by source and target.

The special ids are fixed here once, because the model (padding), the batches
(BOS/EOS) and the decoder (stopping) all depend on them:
``PAD=0, UNK=1, BOS=2, EOS=3``.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import sentencepiece as spm

from transformer_mt.errors import UserError

PAD = 0
UNK = 1
BOS = 2
EOS = 3

MODEL_NAME = "spm.model"  # file names inside `data.dir`
VOCAB_NAME = "spm.vocab"


class BpeError(UserError):
    """Sentencepiece cannot learn the requested vocabulary, or a given model cannot be used; the message says
    what to change."""


def train_bpe(
    sample_file: Path,
    model_prefix: Path,
    vocab_size: int,
    character_coverage: float,
    num_threads: int = 1,
    symbols: list[str] | None = None,
) -> Path:
    """Learn a joint BPE model from ``sample_file`` (one normalized sentence per line).

    Normalization is ``identity`` because the text is already NFC-normalized
    and whitespace-collapsed by `transformer_mt.data.clean.normalize`; that
    makes ``decode(encode(s)) == s`` for any sentence whose characters were
    seen in training. The input is used in file order (no sentencepiece
    sampling): sampling is done, seeded, by the caller.
    Returns the path of the ``.model`` file.
    """
    try:
        spm.SentencePieceTrainer.train(
            input=str(sample_file),
            model_prefix=str(model_prefix),
            vocab_size=vocab_size,
            model_type="bpe",
            character_coverage=character_coverage,
            pad_id=PAD,
            unk_id=UNK,
            bos_id=BOS,
            eos_id=EOS,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            max_sentence_length=1 << 16,
            num_threads=max(1, num_threads),
            minloglevel=2,
            **({"user_defined_symbols": symbols} if symbols else {}),
        )
    except RuntimeError as err:
        raise BpeError(_explain(str(err), vocab_size)) from None
    return Path(f"{model_prefix}.model")


def _explain(message: str, vocab_size: int) -> str:
    """Turn sentencepiece's vocabulary-size complaint into the key to change."""
    match = re.search(
        r"Vocabulary size (?:is )?too (?:large|high) \((\d+)\)\. Please set it to a value <= (\d+)", message
    )
    if match:
        limit = int(match.group(2))
        return (
            f"bpe.vocab_size={vocab_size} cannot be reached on this corpus (at most {limit} pieces exist); "
            f"try --set bpe.vocab_size={limit} or smaller"
        )
    return f"sentencepiece failed to learn bpe.vocab_size={vocab_size}: {message.strip()}"


def load_bpe(path: str | Path) -> spm.SentencePieceProcessor:
    """Load a trained model from a file (e.g. ``data.dir/spm.model``)."""
    return spm.SentencePieceProcessor(model_file=str(path))


def load_bpe_bytes(blob: bytes) -> spm.SentencePieceProcessor:
    """Load a model from its serialized bytes (checkpoints carry it as ``spm_model``)."""
    return spm.SentencePieceProcessor(model_proto=blob)


def read_given_model(path: str | Path) -> tuple[bytes, spm.SentencePieceProcessor]:
    """The bytes and the loaded model of ``bpe.model``, checked to be a sentencepiece model with tmt's special ids.

    The ids matter as much as the pieces: padding, BOS and EOS are fixed
    numbers throughout the model and decoder, so a model from another
    toolkit (sentencepiece's defaults are unk=0, bos=1, eos=2, no pad) would
    train and decode wrongly without an error.
    """
    path = Path(path)
    if not path.is_file():
        raise BpeError(
            f"bpe.model: {path} is not a file (relative to {Path.cwd()}); give the sentencepiece model to encode "
            "with, e.g. written by `tmt export spm -c CKPT -o spm.model`, or set bpe.model='' to learn one"
        )
    blob = path.read_bytes()
    if blob.startswith(b"PK\x03\x04"):  # a zip archive: what torch.save writes
        raise BpeError(
            f"bpe.model: {path} is a checkpoint, not a sentencepiece model; write the model it was trained with "
            f"out with `tmt export spm -c {path} -o spm.model` and set bpe.model to that file"
        )
    sp = _parse(blob, path)
    ids = (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id())
    if ids != (PAD, UNK, BOS, EOS):
        raise BpeError(
            f"bpe.model: {path} has the special ids pad={ids[0]}, unk={ids[1]}, bos={ids[2]}, eos={ids[3]}, but "
            f"tmt needs pad={PAD}, unk={UNK}, bos={BOS}, eos={EOS}; use a model written by `tmt prepare` "
            "(data.dir/spm.model) or `tmt export spm`"
        )
    return blob, sp


def _parse(blob: bytes, path: Path) -> spm.SentencePieceProcessor:
    """Sentencepiece reads empty bytes as an empty model, so a model needs pieces as well as a parse."""
    try:
        sp = load_bpe_bytes(blob)
    except RuntimeError:
        sp = None
    if sp is None or sp.get_piece_size() == 0:
        raise BpeError(
            f"bpe.model: {path} is not a sentencepiece model (it does not parse as one); give an spm.model "
            "written by `tmt prepare` (data.dir/spm.model) or `tmt export spm -c CKPT -o spm.model`"
        )
    return sp


def model_digest(path: str | Path) -> str | None:
    """sha256 of a model file's bytes, or None when it cannot be read: what tells prepared data it is stale."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def write_vocab(sp: spm.SentencePieceProcessor, path: Path) -> None:
    """``spm.vocab`` as sentencepiece's trainer writes it: one ``piece<TAB>score`` line per id, in id order."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size()))
