"""`tmt translate --engine ctranslate2`: tmt's text path around CTranslate2's beam search.

Everything but the search is `Translator`'s: lines read and written the same
way, the same normalization, BPE with the exported sentencepiece model, the
same batches, n-best format and truncation to the model's positions. The
model is a directory written by `tmt export ctranslate2`, whose
``tmt_config.yaml`` carries the decoding settings and languages.

CTranslate2's search differs from tmt's (docs/decoding.md) in three ways:

- it normalizes by ``length ** alpha``, tmt's ``decode.len_penalty_form:
  fairseq`` (EOS counted in the length, as here); the paper's ``((5 +
  length) / 6) ** alpha`` does not exist there, so a ``gnmt`` config with
  alpha > 0 is decoded with ``length ** alpha`` and a warning;
- with alpha > 0 it stops a sentence once k hypotheses have finished, where
  tmt goes on while a live hypothesis can still win;
- a hypothesis that reaches the maximum length ends there without EOS,
  where tmt appends EOS and counts its log-probability.

With alpha 0, and in greedy decoding, both return the same best hypothesis
for every sentence that ends before its maximum length (tested). Each
sentence keeps its own maximum length ``max_len_a * src_len + max_len_b``:
CTranslate2 takes one per call, the batch's longest, and the few sentences
whose output runs past their own are translated again alone.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sentencepiece as spm
import torch
import yaml

from transformer_mt.config import Config, ConfigError, config_from_dict
from transformer_mt.data.bpe import BOS, EOS, PAD, load_bpe
from transformer_mt.decode.search import length_penalty, max_output_lengths
from transformer_mt.decode.translate import (
    TranslateError,
    Translation,
    Translator,
    override_config,
    pad_batch,
    set_decode,
)
from transformer_mt.export import SPM_MODEL, TMT_CONFIG, ExportError, require_ctranslate2


class CTranslate2Translator(Translator):
    """`Translator` whose batches are translated by a `ctranslate2.Translator`."""

    def __init__(self, engine: Any, bpe: spm.SentencePieceProcessor, cfg: Config, device: str | torch.device) -> None:
        self.engine = engine
        self.bpe = bpe
        self.cfg = cfg
        self.device = torch.device(device)
        self.show_progress = True
        self.pieces = [bpe.id_to_piece(i) for i in range(bpe.get_piece_size())]

    @classmethod
    def from_directory(
        cls,
        paths: Sequence[str | Path],
        device: str | torch.device | None = None,
        beam: int | None = None,
        lenpen: float | None = None,
        nbest: int | None = None,
        batch_tokens: int | None = None,
        overrides: Sequence[str] = (),
    ) -> CTranslate2Translator:
        """Load the directory of `tmt export ctranslate2`; settings as in `Translator.from_checkpoints`.

        ``decode.quantize: int8`` (``--quantize int8``) runs CTranslate2 with
        int8 weights whatever type was exported (``compute_type="int8"``).
        """
        directory = _one_directory(paths)
        ct2 = _require()
        cfg = set_decode(_load_config(directory, overrides), beam, lenpen, nbest, batch_tokens)
        device = torch.device(device or "cpu")
        compute_type = "int8" if cfg.decode.quantize == "int8" else "default"
        engine = ct2.Translator(
            str(directory), device=device.type, device_index=device.index or 0, compute_type=compute_type,
            inter_threads=1, intra_threads=torch.get_num_threads(),
        )  # fmt: skip
        if cfg.decode.len_penalty_form == "gnmt" and cfg.decode.len_penalty != 0:
            print(
                f"warning: CTranslate2 normalizes scores by length ** {cfg.decode.len_penalty} (decode.len_penalty_form"
                "=fairseq), not by the paper's ((5 + length) / 6) ** alpha; decoding with length ** alpha (pass "
                "--set decode.len_penalty_form=fairseq to ask for it)",
                file=sys.stderr,
            )
        return cls(engine, load_bpe(directory / SPM_MODEL), cfg, device)

    def _translate_batch(self, sources: list[list[int]], nbest: int) -> list[list[Translation]]:
        limits = self._max_lengths(sources)
        results = self._search(sources, max(limits), nbest)
        for i, result in enumerate(results):
            if any(len(_without_eos(h, self.pieces[EOS])) > limits[i] for h in result.hypotheses):
                results[i] = self._search([sources[i]], limits[i], nbest)[0]  # its own, shorter limit
        return [self._translations(r.hypotheses, r.scores, nbest) for r in results]

    def _max_lengths(self, sources: list[list[int]]) -> list[int]:
        """Each sentence's most output tokens before EOS, as `search.max_output_lengths` computes them."""
        d = self.cfg.decode
        return max_output_lengths(pad_batch(sources), d.max_len_a, d.max_len_b, self.cfg.model.max_positions).tolist()

    def _search(self, sources: list[list[int]], max_len: int, nbest: int) -> list[Any]:
        """CTranslate2's beam search over ``sources`` (ids + EOS), at most ``max_len`` tokens before EOS."""
        d = self.cfg.decode
        return self.engine.translate_batch(
            [[self.pieces[i] for i in ids[:-1]] for ids in sources],  # CTranslate2 appends EOS itself
            beam_size=d.beam_size, num_hypotheses=nbest, length_penalty=d.len_penalty, return_end_token=True,
            min_decoding_length=0, max_decoding_length=max_len, max_input_length=0, return_scores=True,
            suppress_sequences=[[self.pieces[PAD]], [self.pieces[BOS]]],
        )  # fmt: skip

    def _translations(self, hypotheses: list[list[str]], scores: list[float], nbest: int) -> list[Translation]:
        """Detokenized n-best list; log_prob undoes CTranslate2's length normalization (EOS in the length)."""
        found = []
        for pieces, score in zip(hypotheses, scores, strict=True):
            ids = [self.bpe.piece_to_id(p) for p in pieces]
            length = len(ids)
            ids = ids[:-1] if ids and ids[-1] == EOS else ids
            log_prob = score * float(length_penalty(float(length), self.cfg.decode.len_penalty, "fairseq"))
            found.append(Translation(self.bpe.decode(ids), score, log_prob))
        return found + [Translation("", float("-inf"), float("-inf"))] * (nbest - len(found))


def _without_eos(pieces: list[str], eos: str) -> list[str]:
    return pieces[:-1] if pieces and pieces[-1] == eos else pieces


def _require() -> Any:
    try:
        return require_ctranslate2()
    except ExportError as err:
        raise TranslateError(f"--engine ctranslate2: {err}") from None


def _one_directory(paths: Sequence[str | Path]) -> Path:
    """The one model directory of ``-c``; checkpoints cannot be averaged here (average, then export)."""
    if len(paths) != 1:
        raise TranslateError(
            f"--engine ctranslate2 takes one model directory (-c DIR), got {len(paths)}; average checkpoints with "
            "tmt average, then tmt export ctranslate2 -c average.pt -o DIR"
        )
    directory = Path(paths[0])
    for name in (TMT_CONFIG, SPM_MODEL, "model.bin"):
        if not (directory / name).is_file():
            raise TranslateError(
                f"{directory}: no {name}, so not a model directory written by tmt export ctranslate2; "
                f"write one with: tmt export ctranslate2 -c CHECKPOINT -o {directory}"
            )
    return directory


def _load_config(directory: Path, overrides: Sequence[str]) -> Config:
    """The exported tmt config with ``--set`` overrides; the position table is fixed by the export."""
    path = directory / TMT_CONFIG
    try:
        stored = config_from_dict(yaml.safe_load(path.read_text(encoding="utf-8")), origin=str(path))
        cfg = override_config(stored, overrides)
    except (ConfigError, yaml.YAMLError) as err:
        raise TranslateError(str(err)) from None
    if cfg.model.max_positions != stored.model.max_positions:
        raise TranslateError(
            f"{directory} stores a table of {stored.model.max_positions} positions; export again from the checkpoint "
            "with a larger model.max_positions to change it"
        )
    return cfg
