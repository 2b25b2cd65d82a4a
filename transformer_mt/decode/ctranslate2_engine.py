"""CTranslate2's beam search as the search of `Translator` (`tmt translate --engine ctranslate2`).

Everything but the search stays `Translator`'s: lines read and written the
same way, the same normalization, BPE with the exported sentencepiece model,
the same batches, n-best format and truncation to the model's positions. The
model is a directory written by `tmt export ctranslate2`, whose
``tmt_config.yaml`` carries the decoding settings and languages.

CTranslate2's search differs from tmt's (docs/decoding.md) in three ways:

- it normalizes by ``length ** alpha``, tmt's ``decode.len_penalty_form:
  fairseq`` (EOS counted in the length, as here); the paper's ``((5 +
  length) / 6) ** alpha`` does not exist there, so a ``gnmt`` config with
  alpha > 0 is decoded with ``length ** alpha`` and a warning;
- it stops a sentence once k hypotheses have finished (tmt's ``decode.stopping:
  k_finished``), where tmt by default goes on while a live hypothesis can
  still win;
- a hypothesis that reaches the maximum length ends there without EOS,
  where tmt appends EOS and counts its log-probability.

With alpha 0, and in greedy decoding, both return the same best hypothesis
for every sentence that ends before its maximum length (tested). Each
sentence keeps its own maximum length ``max_len_a * src_len + max_len_b``:
CTranslate2 takes one per call, the batch's longest, and the few sentences
whose output runs past their own are translated again alone.

The `ctranslate2` package is optional: imported here only when a search is
built, and by `transformer_mt.export`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import sentencepiece as spm
import torch

from transformer_mt.config import Config, parse_sampling
from transformer_mt.data.bpe import BOS, EOS, PAD
from transformer_mt.decode.search import Hypothesis, pad_batch
from transformer_mt.decode.settings import SearchSettings, length_penalty
from transformer_mt.errors import UserError

TMT_CONFIG = "tmt_config.yaml"  # the files tmt adds to CTranslate2's own in an exported directory
SPM_MODEL = "spm.model"


class CTranslate2Error(UserError):
    """ctranslate2 missing, or a directory that is not an export; the message says what to do."""


def require_ctranslate2() -> ModuleType:
    """The ctranslate2 module, or a CTranslate2Error saying how to install it."""
    try:
        import ctranslate2
    except ImportError:
        raise CTranslate2Error(
            "this needs the ctranslate2 package, which is not installed: pip install ctranslate2 "
            '(or pip install -e ".[ctranslate2]")'
        ) from None
    return ctranslate2


def pieces_of(bpe: spm.SentencePieceProcessor) -> list[str]:
    """The sentencepiece pieces by id: CTranslate2's vocabulary, so that its tokens are the BPE model's."""
    return [bpe.id_to_piece(i) for i in range(bpe.get_piece_size())]


def model_directory(paths: Sequence[str | Path]) -> Path:
    """The one directory of ``-c``, checked to hold what `tmt export ctranslate2` writes."""
    if len(paths) != 1:
        raise CTranslate2Error(
            f"--engine ctranslate2 takes one model directory (-c DIR), got {len(paths)}; average checkpoints with "
            "tmt average, then tmt export ctranslate2 -c average.pt -o DIR"
        )
    directory = Path(paths[0])
    for name in (TMT_CONFIG, SPM_MODEL, "model.bin"):
        if not (directory / name).is_file():
            raise CTranslate2Error(
                f"{directory}: no {name}, so not a model directory written by tmt export ctranslate2; "
                f"write one with: tmt export ctranslate2 -c CHECKPOINT -o {directory}"
            )
    return directory


class CTranslate2Search:
    """Translates batches of source ids with a `ctranslate2.Translator`, as `Translator`'s search."""

    def __init__(self, directory: Path, cfg: Config, bpe: spm.SentencePieceProcessor, device: torch.device) -> None:
        """Load ``directory``; ``decode.quantize: int8`` loads the weights as int8 whatever type was exported."""
        ct2 = require_ctranslate2()
        ct2.set_random_seed(cfg.decode.seed)  # before its threads exist: they seed their generators from it
        self.cfg = cfg
        self.pieces = pieces_of(bpe)
        self.ids = {piece: i for i, piece in enumerate(self.pieces)}
        self.engine = ct2.Translator(
            str(directory), device=device.type, device_index=device.index or 0,
            compute_type="int8" if cfg.decode.quantize == "int8" else "default",
            inter_threads=1, intra_threads=torch.get_num_threads(),
        )  # fmt: skip
        if cfg.decode.len_penalty_form == "gnmt" and cfg.decode.len_penalty != 0:
            print(
                f"warning: CTranslate2 normalizes scores by length ** {cfg.decode.len_penalty} (decode.len_penalty_form"
                "=fairseq), not by the paper's ((5 + length) / 6) ** alpha; decoding with length ** alpha (pass "
                "--set decode.len_penalty_form=fairseq to ask for it)",
                file=sys.stderr,
            )

    def __call__(
        self, sources: list[list[int]], nbest: int, prefixes: list[list[int]] | None = None
    ) -> list[list[Hypothesis]]:
        """The ``nbest`` best hypotheses of each source (ids + EOS), best first, each within its own length limit
        and starting with its ``prefixes`` entry (CTranslate2's ``target_prefix``)."""
        limits = self._max_lengths(sources)
        results = self._search(sources, max(limits), nbest, prefixes)
        for i, result in enumerate(results):
            if any(len(_without_eos(h, self.pieces[EOS])) > limits[i] for h in result.hypotheses):
                alone = None if prefixes is None else [prefixes[i]]
                results[i] = self._search([sources[i]], limits[i], nbest, alone)[0]  # its own, shorter limit
        return [self._hypotheses(r.hypotheses, r.scores) for r in results]

    def _max_lengths(self, sources: list[list[int]]) -> list[int]:
        """Each sentence's most output tokens before EOS, as tmt's own search limits them."""
        return SearchSettings.of(self.cfg).max_lengths(pad_batch(sources)).tolist()

    def _search(
        self, sources: list[list[int]], max_len: int, nbest: int, prefixes: list[list[int]] | None = None
    ) -> list[Any]:
        """CTranslate2's beam search over ``sources``, at most ``max_len`` tokens before EOS; PAD and BOS never.

        With ``decode.sampling``: its random sampling, ``nbest`` samples per source, seeded by ``decode.seed``
        once per call (`sampling_options`).
        """
        d = self.cfg.decode
        return self.engine.translate_batch(
            [[self.pieces[i] for i in ids[:-1]] for ids in sources],  # CTranslate2 appends EOS itself
            beam_size=d.beam_size, num_hypotheses=nbest, length_penalty=d.len_penalty, return_end_token=True,
            min_decoding_length=0, max_decoding_length=max_len, max_input_length=0, return_scores=True,
            suppress_sequences=[[self.pieces[PAD]], [self.pieces[BOS]]], no_repeat_ngram_size=d.no_repeat_ngram,
            target_prefix=None if prefixes is None else [[self.pieces[i] for i in ids] for ids in prefixes],
            **self.sampling_options(),
        )  # fmt: skip

    def sampling_options(self) -> dict[str, Any]:
        """CTranslate2's sampling arguments for ``decode.sampling`` (none without it).

        topk:K is ``sampling_topk=K``; topp:P is ``sampling_topp=P`` over the
        whole vocabulary (``sampling_topk=0``). CTranslate2 draws from one
        random stream per worker thread, seeded with ``decode.seed`` when the
        engine loads (`ctranslate2.set_random_seed`) and never again: a run
        over the same file repeats itself, but a line's sample depends on what
        was drawn before it, its batch and the batches before, unlike tmt's
        (docs/decoding.md).
        """
        d = self.cfg.decode
        sampling = parse_sampling(d.sampling)
        if sampling is None:
            return {}
        topk = int(sampling.value) if sampling.kind == "topk" else 0
        topp = sampling.value if sampling.kind == "topp" else 1.0
        return {"sampling_topk": topk, "sampling_topp": topp, "sampling_temperature": d.sampling_temperature}

    def _hypotheses(self, hypotheses: list[list[str]], scores: list[float]) -> list[Hypothesis]:
        """Token ids without EOS; log_prob undoes CTranslate2's length normalization (EOS in the length)."""
        found = []
        for pieces, score in zip(hypotheses, scores, strict=True):
            ids = [self.ids[p] for p in pieces]
            divisor = float(length_penalty(float(len(ids)), self.cfg.decode.len_penalty, "fairseq"))
            found.append(Hypothesis(ids[:-1] if ids and ids[-1] == EOS else ids, score, score * divisor))
        return found


def _without_eos(pieces: list[str], eos: str) -> list[str]:
    return pieces[:-1] if pieces and pieces[-1] == eos else pieces
