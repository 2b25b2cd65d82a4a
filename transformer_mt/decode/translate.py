"""The `Translator`: raw text in, detokenized translations out, one line per line, in input order.

Each line is normalized (`transformer_mt.data.clean.normalize`, the function
`tmt prepare` applied to the training text), BPE-encoded with the
sentencepiece model stored in the checkpoint, translated with beam search and
decoded back to plain text. Lines are batched by source tokens in length
order (long lines first, so memory problems show at once) and the
translations are put back in input order. An empty line (or one that
normalizes to nothing) gives an empty line without running the model.

Several checkpoints are either averaged into one model (`read_average`, the
paper's way with the last checkpoints of a run) or decoded together as an
`transformer_mt.decode.ensemble.Ensemble`. Input from a terminal, or with
``--buffer-lines N``, is translated N lines at a time as it arrives
(`transformer_mt.decode.stream`); a file or a pipe is read in windows of
``--window-lines`` lines, each batched by length
(`transformer_mt.decode.lines.translate_file`).
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sentencepiece as spm
import torch
import yaml
from tqdm import tqdm

from transformer_mt.config import CLI_NAMES, Config, DecodeMode, config_from_dict, mode_conflict
from transformer_mt.data.batching import batches_by_tokens
from transformer_mt.data.bpe import EOS, UNK, load_bpe
from transformer_mt.data.clean import normalize
from transformer_mt.data.directions import (
    Direction,
    choose,
    directions,
    multilingual,
    source_prefix,
    zero_shot,
)
from transformer_mt.decode.align import alignments
from transformer_mt.decode.aligner import Aligner, aligner_alignments
from transformer_mt.decode.constrained import (
    check_lengths,
    constrained_search,
    encode_constraints,
    split_constraints,
    word_continuations,
)
from transformer_mt.decode.continuous import ContinuousSearch
from transformer_mt.decode.ensemble import Ensemble
from transformer_mt.decode.load import (
    change_decode,
    for_decoding,
    load_ensemble,
    load_model,
    override_config,
    resolve_device,
)
from transformer_mt.decode.sample import sample_search
from transformer_mt.decode.search import Hypothesis, beam_search, pad_batch
from transformer_mt.decode.settings import SearchSettings
from transformer_mt.errors import UserError, out_of_memory
from transformer_mt.malloc import FreedMemory
from transformer_mt.model.transformer import Transformer
from transformer_mt.progress import Bar, progress


class TranslateError(UserError):
    """Input or checkpoint problems a user can fix; the message names the file (and line) and the fix."""


def check_mode(mode: DecodeMode, names: dict[str, str] = CLI_NAMES) -> None:
    """Refuse a combination of decoding choices that `mode_conflict` rules out, with its message."""
    conflict = mode_conflict(mode, names)
    if conflict is not None:
        raise TranslateError(conflict[1])


@dataclass(frozen=True)
class Translation:
    """One hypothesis: detokenized ``text``, normalized ``score`` and raw ``log_prob`` (natural log, EOS included);
    ``alignment``: its word alignment line with ``decode.alignment`` (`transformer_mt.decode.align`), else None."""

    text: str
    score: float
    log_prob: float
    alignment: str | None = None

    def line(self) -> str:
        """The text, and its alignment after a tab when there is one: what an output line shows."""
        return self.text if self.alignment is None else f"{self.text}\t{self.alignment}"


BatchSearch = Callable[[list[list[int]], int, list[list[int]] | None], list[list[Hypothesis]]]
"""The n-best hypotheses (token ids without EOS, best first) of each source of a batch (ids ending in EOS), each
starting with its prefix (target ids; None: no prefixes)."""


ALIGNED_PIVOT = "--alignment with --pivot would link the pivot's words, not the input's: drop one of them"


class Translator:
    """A search, its BPE model and decoding settings; `translate_lines` is the whole text-to-text path.

    The search is tmt's `beam_search` over ``model``, or another engine's
    (`from_ctranslate2`): the text handling around it is the same.
    """

    def __init__(
        self,
        model: Transformer | Ensemble | None,
        bpe: spm.SentencePieceProcessor,
        cfg: Config,
        device: str | torch.device,
        search: BatchSearch | None = None,
        aligner: Aligner | None = None,
    ) -> None:
        if model is None and search is None:
            raise ValueError("Translator needs a model or a search")
        self.model = None if model is None else model.eval()
        self.bpe = bpe
        self.cfg = cfg
        self.device = torch.device(device)
        self.show_progress = True
        self.progress: Bar | None = None  # a bar of the caller's that batches count on, instead of one per call
        self.engine_search = search  # None: tmt's own beam search over ``model``
        self.aligner = aligner  # the checkpoint's word aligner: `--alignment` reads it instead of the attention
        self.freed = FreedMemory()  # what decoding frees stays resident up to a slack (transformer_mt/malloc.py)
        self.direction = choose(cfg.data, None, None) if not multilingual(cfg.data) else None  # `toward` sets it
        self.source_prefix: list[int] = []  # ids every source starts with: a multilingual model's target tag
        self.first_leg: Translator | None = None  # with a pivot: the translator into it (`toward`)

    def toward(
        self,
        src: str | None,
        tgt: str | None,
        where: str = "--src-lang/--tgt-lang",
        any_source: bool = False,
        pivot: str | None = None,
    ) -> Translator:
        """This translator (nothing loaded again) translating ``src`` into ``tgt``; a model of several directions
        needs the target (`choose`: a DirectionError names the model's languages), a model of one pair neither.

        ``pivot``: translate into that language first, then from it into
        ``tgt`` (`through_pivot`), for a pair the model was never trained on:
        its zero-shot output is often in the wrong language, its legs through
        English are not (benchmarks/README.md, "Several languages").
        """
        if pivot is not None and src is None:
            raise TranslateError(f"--pivot {pivot}: name the input's language too, with --src-lang")
        direction = choose(self.cfg.data, src, tgt, where, any_source)
        other = copy.copy(self)
        other.direction = direction
        other.source_prefix = [int(i) for i in source_prefix(self.cfg.data, self.bpe, direction.tgt)]
        other.first_leg = None if pivot is None else self._leg_into(direction, pivot)
        return other

    @property
    def pivot(self) -> str | None:
        """The language translated through (`toward`'s ``pivot``), or None: what evaluations and warnings name."""
        return None if self.first_leg is None or self.first_leg.direction is None else self.first_leg.direction.tgt

    def _leg_into(self, direction: Direction, pivot: str) -> Translator:
        """The first leg of ``direction`` through ``pivot``: the best translation only, without a bar of its own
        (the caller's counts the lines once, on the second leg)."""
        if pivot in (direction.src, direction.tgt):
            raise TranslateError(
                f"--pivot {pivot}: the pivot must differ from the source and the target ({direction.name})"
            )
        if self.cfg.decode.alignment != "none":
            raise TranslateError(ALIGNED_PIVOT)
        choose(self.cfg.data, pivot, direction.tgt, "--pivot")  # the pivot must be a source and a target
        leg = self.toward(direction.src, pivot, "--pivot").with_decode({"nbest": 1})
        leg.show_progress, leg.progress = False, None
        return leg

    def through_pivot(self, lines: Sequence[str], start: int = 0) -> Sequence[str]:
        """``lines`` translated into the pivot (`toward`'s ``pivot``), or ``lines`` themselves without one: one
        translation per line (decoded as the second leg is: beam, or a sample), in order, an empty line empty.
        Text in, text out, so that each leg encodes its input as any translation does."""
        if self.first_leg is None:
            return lines
        if self.cfg.decode.alignment != "none":
            raise TranslateError(ALIGNED_PIVOT)  # alignment set after `toward` (`with_decode`)
        return [hyps[0].text for hyps in self.first_leg.translate_lines_nbest(lines, 1, start)]

    def with_decode(self, changes: Mapping[str, Any]) -> Translator:
        """This translator (the same model and engine, nothing loaded again) decoding with ``changes`` to its
        decode section (``{"beam_size": 1}``), applied and validated as ``--set`` overrides are (`change_decode`):
        per-request settings of a server. Without changes, this translator itself."""
        if not changes:
            return self
        other = copy.copy(self)
        other.cfg = change_decode(self.cfg, changes)
        if self.engine_search is not None:
            other.engine_search = copy.copy(self.engine_search)
            other.engine_search.cfg = other.cfg
        return other

    def mode(self, nbest: int | None = None, constraints: bool = False, prefixes: bool = False) -> DecodeMode:
        """The decoding choices of a call with ``nbest`` (default decode.nbest), ``constraints`` and ``prefixes``
        on this translator's engine and model: what `check_mode` judges."""
        engine = "pytorch" if self.engine_search is None else "ctranslate2"
        ensemble = isinstance(self.model, Ensemble)
        return DecodeMode.of(self.cfg.decode, nbest, constraints=constraints, prefixes=prefixes, engine=engine,
                             ensemble=ensemble)  # fmt: skip

    def search(
        self, sources: list[list[int]], nbest: int, prefixes: list[list[int]] | None = None
    ) -> list[list[Hypothesis]]:
        """The ``nbest`` best hypotheses of each source (ids ending in EOS), each starting with its ``prefixes``
        entry (target ids, [] for none): tmt's beam search, or the engine's."""
        if self.engine_search is None:
            return self._own_search(sources, nbest, prefixes)
        return self.engine_search(sources, nbest, prefixes)

    @classmethod
    def from_checkpoints(
        cls,
        paths: Sequence[str | Path],
        device: str | torch.device | None = None,
        overrides: Sequence[str] = (),
        ensemble: bool = False,
    ) -> Translator:
        """Load one checkpoint; several are averaged on the fly (`read_average`, exactly as `tmt average` does),
        or with ``ensemble`` decoded together, each model whole (`load_ensemble`).

        Decoding settings come from the config stored in the (newest; with
        ``ensemble``, the first) checkpoint, then ``overrides`` (``--set``
        texts, and the decoding flags as `decode_flags` spells them; see
        `override_config`). The model decodes with `for_decoding`'s layers.
        """
        if ensemble and len(paths) > 1:
            members = load_ensemble(paths, device, overrides)
            first = members[0]
            model: Transformer | Ensemble = Ensemble([for_decoding(m.model, m.config) for m in members])
            return cls(model, first.bpe, first.config, first.device)
        loaded = load_model(paths, device, overrides)
        model = for_decoding(loaded.model, loaded.config)
        return cls(model, loaded.bpe, loaded.config, loaded.device, aligner=loaded.aligner)

    @classmethod
    def from_ctranslate2(
        cls,
        paths: Sequence[str | Path],
        device: str | torch.device | None = None,
        overrides: Sequence[str] = (),
    ) -> Translator:
        """A directory of `tmt export ctranslate2`, searched by CTranslate2 (`decode.ctranslate2_engine`).

        Settings as in `from_checkpoints`, from the exported config; its position table is fixed.
        """
        from transformer_mt.decode.ctranslate2_engine import (
            SPM_MODEL,
            CTranslate2Error,
            CTranslate2Search,
            model_directory,
        )

        try:
            directory = model_directory(paths)
            cfg = _exported_config(directory, overrides)
            bpe = load_bpe(directory / SPM_MODEL)
            device = resolve_device(device, default="cpu")
            return cls(None, bpe, cfg, device, search=CTranslate2Search(directory, cfg, bpe, device))
        except CTranslate2Error as err:
            raise TranslateError(f"--engine ctranslate2: {err}") from None

    # -- text to text

    def translate_lines(self, lines: Sequence[str]) -> list[str]:
        """One detokenized translation per line, in order; empty lines give empty lines."""
        return [hyps[0].text for hyps in self.translate_lines_nbest(lines, nbest=1)]

    def translate_lines_nbest(
        self,
        lines: Sequence[str],
        nbest: int | None = None,
        start: int = 0,
        prefixes: Sequence[str] | None = None,
        prefix_origin: str = "prefix",
    ) -> list[list[Translation]]:
        """The ``nbest`` (default: decode.nbest) best translations of every line, best first.

        An empty line gets ``nbest`` empty translations with score 0 (with a
        prefix: the prefix alone). ``start``: the 0-based input line number of
        ``lines[0]``, for warnings and errors. ``prefixes``: one target text per
        line ("" for none) that its translations start with (`encode_prefix`);
        ``prefix_origin`` names them in errors (the --prefix-file).
        """
        nbest = self.cfg.decode.nbest if nbest is None else nbest
        check_mode(self.mode(nbest, prefixes=prefixes is not None))
        if prefixes is not None and len(prefixes) != len(lines):
            raise TranslateError(f"{prefix_origin}: {len(prefixes)} prefixes for {len(lines)} lines; give one per line")
        ids = [self.encode(start + i, line) for i, line in enumerate(self.through_pivot(lines, start))]
        forced = [
            self.encode_prefix(start + i, text, source, prefix_origin) for i, (text, source) in enumerate(zip(prefixes, ids, strict=True))
        ] if prefixes is not None else None  # fmt: skip
        return self.translate_encoded(ids, nbest, forced)

    def translate_encoded(
        self,
        sources: Sequence[list[int]],
        nbest: int,
        prefixes: Sequence[list[int]] | None = None,
        phrases: Sequence[list[list[int]]] | None = None,
    ) -> list[list[Translation]]:
        """The ``nbest`` best translations of already encoded lines (`encode`: ids and EOS, [] for an empty line),
        batched by length; ``prefixes``: each line's forced target ids, ``phrases``: each line's constraints
        (encoded phrases, [] for none; those lines are searched by `constrained_search`, in batches of their own).

        An empty line gets ``nbest`` empty translations with score 0 (with a prefix: the prefix alone).
        """
        check_mode(self.mode(nbest, constraints=phrases is not None, prefixes=prefixes is not None))
        empty_alignment = None if self.cfg.decode.alignment == "none" else ""
        results: list[list[Translation]] = [
            []
            if x
            else [Translation(self.bpe.decode(prefixes[i]) if prefixes else "", 0.0, 0.0, empty_alignment)] * nbest
            for i, x in enumerate(sources)
        ]
        todo = [i for i, x in enumerate(sources) if x]
        groups = [(todo, False)] if phrases is None else [
            ([i for i in todo if not phrases[i]], False), ([i for i in todo if phrases[i]], True)
        ]  # fmt: skip
        continues_word = None if phrases is None else word_continuations(self.bpe).to(self.device)
        with self._progress(len(sources)) as bar:
            bar.update(len(sources) - len(todo))
            for group, constrained in groups:
                for batch in batches_by_tokens(group, [len(sources[i]) for i in group], self.cfg.decode.batch_tokens):
                    batch_prefixes = None if prefixes is None else [prefixes[i] for i in batch]
                    batch_phrases = ([phrases[i] for i in batch], continues_word) if constrained else None
                    found = self._translate_batch([sources[i] for i in batch], nbest, batch_prefixes, batch_phrases)
                    for i, hyps in zip(batch, found, strict=True):
                        results[i] = hyps
                    bar.update(len(batch))
                    self.freed.release()  # what a batch freed goes back to the system: memory stays at one batch's
        return results

    def _progress(self, total: int) -> contextlib.AbstractContextManager[Bar]:
        """The caller's bar (``progress``), or a bar of this call's ``total`` lines (shown with ``show_progress``)."""
        if self.progress is not None:
            return contextlib.nullcontext(self.progress)
        return progress(total=total, unit="sent", desc="translate", disable=not self.show_progress)

    def encode(self, index: int, line: str) -> list[int]:
        """Normalized, BPE-encoded source ids plus EOS ([] for an empty line), truncated to the model's positions."""
        text = normalize(line)
        if not text:
            return []
        if self.direction is None:
            raise TranslateError("this model translates several directions: choose one (--src-lang, --tgt-lang)")
        ids = self.bpe.encode(text, out_type=int)
        limit = self.cfg.model.max_positions - 1 - len(self.source_prefix)
        if len(ids) > limit:
            tqdm.write(
                f"warning: line {index + 1}: {len(ids)} BPE tokens, more than the model's max_positions "
                f"({self.cfg.model.max_positions}) allow; translating only its first {limit} tokens",
                file=sys.stderr,
            )
            ids = ids[:limit]
        return self.source_prefix + ids + [EOS]

    def encode_prefix(self, index: int, text: str, source: list[int], origin: str = "prefix") -> list[int]:
        """The target ids that line ``index`` (0-based) must start with: ``text`` normalized and BPE-encoded
        as the training targets were; [] for an empty one. A character the vocabulary lacks (it would be
        forced as <unk>) or a prefix longer than the line's maximum output length (of a non-empty ``source``)
        is a TranslateError."""
        normal = normalize(text)
        if not normal:
            return []
        ids = self.bpe.encode(normal, out_type=int)
        if UNK in ids:
            pieces = self.bpe.encode(normal, out_type=str)
            unknown = "".join(p for p, i in zip(pieces, ids, strict=True) if i == UNK).replace("\u2581", " ").strip()
            raise TranslateError(
                f"{origin}: line {index + 1}: {unknown!r} is not in the model's vocabulary, so the prefix cannot be "
                "forced (it would be <unk>); write the prefix without those characters"
            )
        if not source:  # nothing to translate: the output is the prefix alone, at any length
            return ids
        limit = int(SearchSettings.of(self.cfg).max_lengths(pad_batch([source]))[0])
        if len(ids) > limit:
            raise TranslateError(
                f"{origin}: line {index + 1}: the prefix is {len(ids)} BPE tokens, more than the line's maximum output "
                f"length of {limit} (decode.max_len_a x source tokens + decode.max_len_b); shorten the prefix or "
                "raise the limit, e.g. --set decode.max_len_b=200"
            )
        return ids

    def _oom_message(self, sources: list[list[int]]) -> str:
        """The decoding batch that did not fit, and half its --batch-tokens (the output is the same, only slower)."""
        tokens = self.cfg.decode.batch_tokens
        return (
            f"out of memory translating a batch of {len(sources)} sentences of up to {max(map(len, sources))} "
            f"tokens (decode.batch_tokens={tokens}); try --batch-tokens {max(tokens // 2, 1)}: the same "
            "translations, in smaller batches"
        )

    def _translate_batch(
        self,
        sources: list[list[int]],
        nbest: int,
        prefixes: list[list[int]] | None = None,
        phrases: tuple[list[list[list[int]]], torch.Tensor] | None = None,
    ) -> list[list[Translation]]:
        """The ``nbest`` translations of each source, with their alignments when asked; ``phrases``: each
        source's constraint phrases and the tokens that continue a word (`_constrained_search`)."""
        with out_of_memory(lambda: self._oom_message(sources), TranslateError):
            if phrases is None:
                found = self.search(sources, nbest, prefixes)
            else:
                found = self._constrained_search(sources, phrases[0], nbest, phrases[1])
            aligned = self._alignments(sources, found)
        return [self.translations(hyps, nbest, lines) for hyps, lines in zip(found, aligned, strict=True)]

    def translations(
        self, hyps: Sequence[Hypothesis], nbest: int, alignments: Sequence[str | None] | None = None
    ) -> list[Translation]:
        """The first ``nbest`` of a line's hypotheses as text, with their ``alignments``; a search that found
        fewer is filled up with empty translations of score -inf."""
        lines = alignments if alignments is not None else [None] * len(hyps)
        done = [
            Translation(self.bpe.decode(h.tokens), h.score, h.log_prob, a)
            for h, a in zip(hyps[:nbest], lines[:nbest], strict=True)
        ]
        missing = Translation("", float("-inf"), float("-inf"), None if self.cfg.decode.alignment == "none" else "")
        return done + [missing] * (nbest - len(done))

    def continuous_search(self) -> ContinuousSearch | None:
        """A search that sentences join while it runs (`transformer_mt.decode.continuous`), with this
        translator's settings, for `tmt serve`; None where they need whole batches: another engine, an
        ensemble, sampling, word alignments or constraints."""
        d = self.cfg.decode
        if self.engine_search is not None or not isinstance(self.model, Transformer):
            return None
        if d.sampling != "none" or d.alignment != "none":
            return None
        return ContinuousSearch(self.model, SearchSettings.of(self.cfg), after_step=self.freed.check)

    def translate_constrained(self, lines: Sequence[str], nbest: int, start: int = 0) -> list[list[Translation]]:
        """`translate_lines_nbest` of ``source<TAB>phrase<TAB>...`` lines: each translation holds every phrase.

        The phrases are checked and encoded before anything is translated, so
        a bad line fails at once (`ConstraintError`, naming the line). Lines
        without phrases are searched by `beam_search` as without
        ``--constraints``; the others by `constrained_search`, in batches of
        their own (`translate_encoded`).
        """
        check_mode(self.mode(nbest, constraints=True))
        split = [split_constraints(line, start + i) for i, line in enumerate(lines)]
        sources = self.through_pivot([source for source, _ in split], start)
        ids = [self.encode(start + i, source) for i, source in enumerate(sources)]
        phrases = [self.encode_constraints(texts, ids[i], f"--constraints: line {start + i + 1}")
                   for i, (_, texts) in enumerate(split)]  # fmt: skip
        return self.translate_encoded(ids, nbest, phrases=phrases)

    def encode_constraints(self, texts: Sequence[str], source: list[int], where: str) -> list[list[int]]:
        """A line's constraint phrases as the model's tokens (`encode_constraints`), checked to fit in the line's
        longest output; ``where`` names the line in errors."""
        phrases = encode_constraints(self.bpe, texts, where)
        if phrases and source:
            check_lengths(where, phrases, source, SearchSettings.of(self.cfg))
        return phrases

    def _constrained_search(
        self, sources: list[list[int]], phrases: list[list[list[int]]], nbest: int, continues_word: torch.Tensor
    ) -> list[list[Hypothesis]]:
        """`constrained_search` over ``self.model`` with the decode section's settings."""
        src = pad_batch(sources).to(self.device)
        settings = SearchSettings.of(self.cfg)
        return constrained_search(
            self.model, src, phrases, settings, nbest, continues_word, after_step=self.freed.check
        )

    def _alignments(self, sources: list[list[int]], found: list[list[Hypothesis]]) -> list[list[str | None]]:
        """Each hypothesis' alignment line (`align`), or None without ``decode.alignment``."""
        if self.cfg.decode.alignment == "none":
            return [[None] * len(hyps) for hyps in found]
        pairs = [(src, h.tokens) for src, hyps in zip(sources, found, strict=True) for h in hyps]
        flat = iter(self.align([p[0] for p in pairs], [p[1] for p in pairs]))
        return [[next(flat) for _ in hyps] for hyps in found]

    def align(self, sources: list[list[int]], targets: list[list[int]]) -> list[str]:
        """The ``decode.alignment`` line ("soft" or "hard", `transformer_mt.decode.align`) of each pair of a source
        (`encode`'s ids, EOS included) and a target (the model's tokens, without EOS): a search's hypothesis, or a
        given text such as a reference. By the checkpoint's aligner when it has one and ``decode.use_aligner``,
        else by the attention of ``decode.alignment_layer``."""
        d = self.cfg.decode
        if d.alignment == "none":
            raise TranslateError("align needs decode.alignment soft or hard")
        assert isinstance(self.model, Transformer), "check_mode refuses alignments of an ensemble or an engine"
        skip = len(self.source_prefix)  # the target tag is no word of the source text
        if self.aligner is not None and d.use_aligner:
            return aligner_alignments(
                self.model, self.aligner, self.bpe, sources, targets, d.alignment, d.aligner_threshold, skip
            )
        layer = d.alignment_layer or self.model.cfg.decoder_layers  # 0: the top layer
        return alignments(self.model, self.bpe, sources, targets, layer, d.alignment, skip)

    def _own_search(
        self, sources: list[list[int]], nbest: int, prefixes: list[list[int]] | None = None
    ) -> list[list[Hypothesis]]:
        """tmt's own search, `beam_search` over ``self.model`` with the decode section's settings; with
        ``decode.sampling``, ``nbest`` samples of each source (`sample_search`)."""
        settings, src = SearchSettings.of(self.cfg), pad_batch(sources).to(self.device)
        if settings.sampling is not None:
            return sample_search(self.model, src, sources, settings, nbest, prefixes, after_step=self.freed.check)
        return beam_search(self.model, src, settings, nbest, prefixes, after_step=self.freed.check)


def _exported_config(directory: Path, overrides: Sequence[str]) -> Config:
    """The tmt config stored by `tmt export ctranslate2`, with ``--set`` overrides; its position table is fixed."""
    from transformer_mt.decode.ctranslate2_engine import TMT_CONFIG

    path = directory / TMT_CONFIG
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise TranslateError(f"{path}: not valid YAML ({err}); export the model again") from None
    stored = config_from_dict(raw, origin=str(path))
    cfg = override_config(stored, overrides)
    if cfg.model.max_positions != stored.model.max_positions:
        raise TranslateError(
            f"{directory} stores a table of {stored.model.max_positions} positions; export again from the checkpoint "
            "with a larger model.max_positions to change it"
        )
    return cfg


ENGINES = ("pytorch", "ctranslate2")


def load_translator(
    paths: Sequence[str | Path],
    engine: str = "pytorch",
    ensemble: bool = False,
    device: str | torch.device | None = None,
    overrides: Sequence[str] = (),
    languages: tuple[str | None, str | None] | None = (None, None),
    pivot: str | None = None,
) -> Translator:
    """tmt's own model from checkpoints (``pytorch``), or a `tmt export ctranslate2` directory (``ctranslate2``).

    ``ensemble``: several checkpoints decode together instead of being
    averaged (tmt's search only). ``overrides``: ``--set`` texts, the
    decoding flags included (`decode_flags`). ``languages``: the source and
    target (``--src-lang``, ``--tgt-lang``), needed by a model of several
    directions (`Translator.toward`); a direction it was never trained on is
    translated with a warning (zero-shot). None: no direction is chosen yet
    (the caller's `toward` does). ``pivot``: translate through that language
    (``--pivot``, `Translator.toward`).
    """
    check_mode(DecodeMode(engine=engine, ensemble=ensemble))
    if engine == "ctranslate2":
        translator = Translator.from_ctranslate2(paths, device, overrides)
    elif engine != "pytorch":
        raise TranslateError(f"--engine {engine!r} is not one of {', '.join(ENGINES)}")
    else:
        translator = Translator.from_checkpoints(paths, device, overrides, ensemble=ensemble)
    if languages is None:
        return translator
    translator = translator.toward(*languages, pivot=pivot)
    warning = zero_shot_warning(translator)
    if warning:
        tqdm.write(warning, file=sys.stderr)
    return translator


def zero_shot_warning(translator: Translator) -> str | None:
    """A warning when ``translator`` (or, through a pivot, either of its legs) translates a direction its model was
    never trained on, naming a pivot that would avoid it; None otherwise."""
    data, way, pivot = translator.cfg.data, translator.direction, translator.pivot
    if way is None:
        return None
    legs = [way] if pivot is None else [Direction(way.src, pivot), Direction(pivot, way.tgt)]
    untrained = [leg for leg in legs if zero_shot(data, leg)]
    if not untrained:
        return None
    trained = directions(data)
    hubs = [p for p in dict.fromkeys(d.tgt for d in trained) if {Direction(way.src, p), Direction(p, way.tgt)}
            <= set(trained)]  # fmt: skip
    advice = f"; --pivot {hubs[0]} translates through a language it was trained on" if hubs else ""
    return (
        f"warning: the model was never trained on {', '.join(leg.name for leg in untrained)} (it was on "
        f"{', '.join(d.name for d in trained)}): translating zero-shot; check that the output is in the language "
        f"asked for{advice}"
    )
