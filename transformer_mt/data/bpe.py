"""The joint sentencepiece BPE vocabulary shared by source and target.

The special ids are fixed here once, because the model (padding), the batches
(BOS/EOS) and the decoder (stopping) all depend on them:
``PAD=0, UNK=1, BOS=2, EOS=3``.
"""

from __future__ import annotations

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
    """Sentencepiece cannot learn the requested vocabulary; the message says what to change."""


def train_bpe(
    sample_file: Path, model_prefix: Path, vocab_size: int, character_coverage: float, num_threads: int = 1
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
