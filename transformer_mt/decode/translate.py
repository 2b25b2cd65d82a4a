"""`tmt translate`: raw text in, detokenized translations out, one line per line, in input order.

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
(`transformer_mt.decode.stream`); a file or a pipe is read whole and batched
by length.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm
import torch
import yaml
from tqdm import tqdm

from transformer_mt.config import Config, config_from_dict
from transformer_mt.data.batching import batches_by_tokens
from transformer_mt.data.bpe import EOS, load_bpe
from transformer_mt.data.clean import normalize, read_lines
from transformer_mt.decode.constrained import (
    check_lengths,
    constrained_search,
    encode_constraints,
    split_constraints,
    word_continuations,
)
from transformer_mt.decode.ensemble import Ensemble
from transformer_mt.decode.load import for_decoding, load_ensemble, load_model, override_config, resolve_device
from transformer_mt.decode.search import Hypothesis, beam_search, pad_batch
from transformer_mt.errors import UserError
from transformer_mt.files import atomic_write_lines
from transformer_mt.malloc import release_free_memory
from transformer_mt.model.transformer import Transformer


class TranslateError(UserError):
    """Input or checkpoint problems a user can fix; the message names the file (and line) and the fix."""


CONSTRAINTS_ENGINE = (
    "--constraints needs tmt's own search (--engine pytorch): CTranslate2 has no lexical constraints; translate "
    "with the checkpoint the export came from"
)


@dataclass(frozen=True)
class Translation:
    """One hypothesis: detokenized ``text``, normalized ``score`` and raw ``log_prob`` (natural log, EOS included)."""

    text: str
    score: float
    log_prob: float


BatchSearch = Callable[[list[list[int]], int], list[list[Hypothesis]]]
"""The n-best hypotheses (token ids without EOS, best first) of each source of a batch (ids ending in EOS)."""


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
    ) -> None:
        if model is None and search is None:
            raise ValueError("Translator needs a model or a search")
        self.model = None if model is None else model.eval()
        self.bpe = bpe
        self.cfg = cfg
        self.device = torch.device(device)
        self.show_progress = True
        self.engine_search = search  # None: tmt's own beam search over ``model``
        self.constraints = False  # True: each line is source<TAB>phrase<TAB>... (`translate_constrained`)

    def with_decode(self, overrides: Sequence[str]) -> Translator:
        """This translator (the same model and engine, nothing loaded again) decoding with ``--set decode.*``
        ``overrides`` applied to its config, validated (`override_config`): per-request settings of a server."""
        if not overrides:
            return self
        other = copy.copy(self)
        other.cfg = override_config(self.cfg, overrides)
        if self.engine_search is not None:
            other.engine_search = copy.copy(self.engine_search)
            other.engine_search.cfg = other.cfg
        return other

    def search(self, sources: list[list[int]], nbest: int) -> list[list[Hypothesis]]:
        """The ``nbest`` best hypotheses of each source (ids ending in EOS): tmt's beam search, or the engine's."""
        if self.engine_search is None:
            return self._beam_search(sources, nbest)
        return self.engine_search(sources, nbest)

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
        return cls(for_decoding(loaded.model, loaded.config), loaded.bpe, loaded.config, loaded.device)

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
        self, lines: Sequence[str], nbest: int | None = None, start: int = 0
    ) -> list[list[Translation]]:
        """The ``nbest`` (default: decode.nbest) best translations of every line, best first.

        An empty line gets ``nbest`` empty translations with score 0.
        ``start``: the 0-based input line number of ``lines[0]``, for warnings.
        """
        nbest = self.cfg.decode.nbest if nbest is None else nbest
        if not 1 <= nbest <= self.cfg.decode.beam_size:
            raise TranslateError(f"--nbest {nbest} must be between 1 and the beam size ({self.cfg.decode.beam_size})")
        if self.constraints:
            return self.translate_constrained(lines, nbest, start)
        ids = [self.encode(start + i, line) for i, line in enumerate(lines)]
        results: list[list[Translation]] = [[Translation("", 0.0, 0.0)] * nbest if not x else [] for x in ids]
        todo = [i for i, x in enumerate(ids) if x]
        with tqdm(
            total=len(lines), unit="sent", desc="translate", file=sys.stderr, disable=not self.show_progress
        ) as bar:
            bar.update(len(lines) - len(todo))
            for batch in batches_by_tokens(todo, [len(ids[i]) for i in todo], self.cfg.decode.batch_tokens):
                for i, hyps in zip(batch, self._translate_batch([ids[i] for i in batch], nbest), strict=True):
                    results[i] = hyps
                bar.update(len(batch))
                release_free_memory()  # what the batch freed goes back to the system: memory stays at one batch's
        return results

    def encode(self, index: int, line: str) -> list[int]:
        """Normalized, BPE-encoded source ids plus EOS ([] for an empty line), truncated to the model's positions."""
        text = normalize(line)
        if not text:
            return []
        ids = self.bpe.encode(text, out_type=int)
        limit = self.cfg.model.max_positions - 1
        if len(ids) > limit:
            tqdm.write(
                f"warning: line {index + 1}: {len(ids)} BPE tokens, more than the model's max_positions "
                f"({self.cfg.model.max_positions}) allow; translating only its first {limit} tokens",
                file=sys.stderr,
            )
            ids = ids[:limit]
        return ids + [EOS]

    def _translate_batch(self, sources: list[list[int]], nbest: int) -> list[list[Translation]]:
        results = []
        for hyps in self.search(sources, nbest):
            found = [Translation(self.bpe.decode(h.tokens), h.score, h.log_prob) for h in hyps]
            results.append(found + [Translation("", float("-inf"), float("-inf"))] * (nbest - len(found)))
        return results

    def translate_constrained(self, lines: Sequence[str], nbest: int, start: int = 0) -> list[list[Translation]]:
        """`translate_lines_nbest` of ``source<TAB>phrase<TAB>...`` lines: each translation holds every phrase.

        The phrases are checked and encoded before anything is translated, so
        a bad line fails at once (`ConstraintError`, naming the line). Lines
        without phrases are searched by `beam_search` as without
        ``--constraints``; the others by `constrained_search`, in batches of
        their own.
        """
        if self.engine_search is not None:
            raise TranslateError(CONSTRAINTS_ENGINE)
        d = self.cfg.decode
        split = [split_constraints(line, start + i) for i, line in enumerate(lines)]
        ids = [self.encode(start + i, source) for i, (source, _) in enumerate(split)]
        phrases = [encode_constraints(self.bpe, texts, start + i) for i, (_, texts) in enumerate(split)]
        for i, (x, p) in enumerate(zip(ids, phrases, strict=True)):
            if p:
                check_lengths(start + i, p, x, d.max_len_a, d.max_len_b, self.cfg.model.max_positions)
        results: list[list[Translation]] = [[Translation("", 0.0, 0.0)] * nbest if not x else [] for x in ids]
        continues_word = word_continuations(self.bpe).to(self.device)
        groups = ([i for i, x in enumerate(ids) if x and not phrases[i]], [i for i, x in enumerate(ids) if phrases[i]])
        with tqdm(
            total=len(lines), unit="sent", desc="translate", file=sys.stderr, disable=not self.show_progress
        ) as bar:
            bar.update(len(lines) - len(groups[0]) - len(groups[1]))
            for group, constrained in zip(groups, (False, True), strict=True):
                for batch in batches_by_tokens(group, [len(ids[i]) for i in group], d.batch_tokens):
                    sources = [ids[i] for i in batch]
                    if constrained:
                        found = self._constrained_search(sources, [phrases[i] for i in batch], nbest, continues_word)
                        texts = [self._texts(hyps, nbest) for hyps in found]
                    else:
                        texts = self._translate_batch(sources, nbest)
                    for i, translations in zip(batch, texts, strict=True):
                        results[i] = translations
                    bar.update(len(batch))
                    release_free_memory()
        return results

    def _texts(self, hyps: list[Hypothesis], nbest: int) -> list[Translation]:
        """``nbest`` translations of the hypotheses of one line: empty ones with -inf after those found."""
        found = [Translation(self.bpe.decode(h.tokens), h.score, h.log_prob) for h in hyps]
        return found + [Translation("", float("-inf"), float("-inf"))] * (nbest - len(found))

    def _constrained_search(
        self, sources: list[list[int]], phrases: list[list[list[int]]], nbest: int, continues_word: torch.Tensor
    ) -> list[list[Hypothesis]]:
        """`constrained_search` over ``self.model`` with the decode section's settings."""
        d = self.cfg.decode
        return constrained_search(
            self.model, pad_batch(sources).to(self.device), phrases, beam_size=d.beam_size, len_penalty=d.len_penalty,
            len_penalty_form=d.len_penalty_form, max_len_a=d.max_len_a, max_len_b=d.max_len_b, nbest=nbest,
            max_positions=self.cfg.model.max_positions, no_repeat_ngram=d.no_repeat_ngram, stopping=d.stopping,
            continues_word=continues_word,
        )  # fmt: skip

    def _beam_search(self, sources: list[list[int]], nbest: int) -> list[list[Hypothesis]]:
        """tmt's own search, `beam_search` over ``self.model`` with the decode section's settings."""
        d = self.cfg.decode
        return beam_search(
            self.model, pad_batch(sources).to(self.device), beam_size=d.beam_size, len_penalty=d.len_penalty,
            len_penalty_form=d.len_penalty_form, max_len_a=d.max_len_a, max_len_b=d.max_len_b, nbest=nbest,
            max_positions=self.cfg.model.max_positions, no_repeat_ngram=d.no_repeat_ngram, stopping=d.stopping,
        )  # fmt: skip


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


# -- files


def input_lines(input: str | Path | None) -> Iterator[str]:
    """Lines of ``input`` (stdin when None) as they arrive, by `transformer_mt.data.clean.read_lines`.

    UTF-8, split on '\\n' only. A line is yielded as soon as it is complete, so
    a terminal or a pipe that stays open is read line by line; a bad byte or
    an unreadable file is a UserError naming the input (and the line).
    """
    if input is None and sys.stdin is None:
        raise TranslateError("standard input is closed; pass -i FILE, or pipe or type the text in")
    name = "<stdin>" if input is None else str(input)
    lines = read_lines(name, sys.stdin.buffer if input is None else None)
    while True:
        try:
            line = next(lines)
        except StopIteration:
            return
        except OSError as err:
            raise TranslateError(f"{name}: cannot read the input ({err.strerror})") from None
        yield line


def read_input_lines(input: str | Path | None) -> list[str]:
    """Every line of ``input`` (stdin when None), read to the end: see `input_lines`."""
    return list(input_lines(input))


EMPTY_OUTPUT_LIMIT = 0.05  # warn when more than this fraction of non-empty input lines translate to nothing


def empty_outputs(sources: Sequence[str], outputs: Sequence[str]) -> tuple[int, str | None]:
    """How many non-empty ``sources`` got an empty translation, and a warning when more than 5% of them did.

    A line is empty when it normalizes to nothing (what `Translator` leaves
    untranslated). A trained model almost never answers a real sentence with
    nothing; a model stopped early, inside its learning-rate warmup, often
    does. `tmt translate` and `tmt evaluate` print the warning on stderr.
    """
    given, empty = count_empty(sources, outputs)
    return empty, empty_warning(given, empty)


def count_empty(sources: Sequence[str], outputs: Sequence[str]) -> tuple[int, int]:
    """(non-empty sources, those of them translated to nothing): the counts `empty_warning` judges."""
    given = [i for i, line in enumerate(sources) if normalize(line)]
    return len(given), sum(1 for i in given if not outputs[i].strip())


def empty_warning(given: int, empty: int) -> str | None:
    """The warning of `empty_outputs` for ``empty`` of ``given`` non-empty lines, or None within the limit."""
    if not given or empty <= EMPTY_OUTPUT_LIMIT * given:
        return None
    return (
        f"warning: {empty} of {given} non-empty input lines ({100 * empty / given:.1f}%) got an empty "
        f"translation (more than {EMPTY_OUTPUT_LIMIT:.0%}); the likely cause is an undertrained checkpoint, such as "
        "a run stopped inside its learning-rate warmup (`tmt train` warns when it stops there): train longer "
        "(train.max_updates / train.max_minutes) or shorten the warmup (train.warmup), then translate again"
    )


def format_nbest(results: Sequence[Sequence[Translation]], start: int = 0) -> list[str]:
    """``index<TAB>score<TAB>text`` lines: 0-based input line index (the first is ``start``), normalized score."""
    return [f"{start + i}\t{t.score:.4f}\t{t.text}" for i, hyps in enumerate(results) for t in hyps]


ENGINES = ("pytorch", "ctranslate2")


def load_translator(
    paths: Sequence[str | Path],
    engine: str = "pytorch",
    ensemble: bool = False,
    device: str | torch.device | None = None,
    overrides: Sequence[str] = (),
) -> Translator:
    """tmt's own model from checkpoints (``pytorch``), or a `tmt export ctranslate2` directory (``ctranslate2``).

    ``ensemble``: several checkpoints decode together instead of being
    averaged (tmt's search only). ``overrides``: ``--set`` texts, the
    decoding flags included (`decode_flags`).
    """
    if engine == "ctranslate2":
        if ensemble:
            raise TranslateError(
                "--ensemble runs tmt's own search over tmt checkpoints (--engine pytorch); --engine ctranslate2 "
                "decodes one exported model"
            )
        return Translator.from_ctranslate2(paths, device, overrides)
    if engine != "pytorch":
        raise TranslateError(f"--engine {engine!r} is not one of {', '.join(ENGINES)}")
    return Translator.from_checkpoints(paths, device, overrides, ensemble=ensemble)


def write_stdout(lines: Sequence[str]) -> None:
    """``lines`` on stdout, each ended by '\\n', as UTF-8 whatever the locale says, flushed."""
    text = "".join(line + "\n" for line in lines)
    stdout = getattr(sys.stdout, "buffer", None)
    if stdout is not None:
        sys.stdout.flush()
        stdout.write(text.encode("utf-8"))
        stdout.flush()
    else:
        sys.stdout.write(text)
        sys.stdout.flush()


def translate_file(
    checkpoints: Sequence[str | Path],
    input: str | Path | None = None,
    output: str | Path | None = None,
    device: str | None = None,
    overrides: Sequence[str] = (),
    engine: str = "pytorch",
    ensemble: bool = False,
    constraints: bool = False,
) -> None:
    """Translate ``input`` (stdin when None) to ``output`` (stdout when None), read whole and batched by length.

    The input is read before the model loads, so bad input fails fast. See
    `tmt translate --help`; `transformer_mt.decode.stream` translates as lines arrive instead.
    ``constraints``: each line is ``source<TAB>phrase<TAB>...`` (`Translator.translate_constrained`).
    """
    lines = read_input_lines(input)
    for i, line in enumerate(lines if constraints else []):
        split_constraints(line, i)  # the line's format, before the model loads
    translator = load_translator(checkpoints, engine, ensemble, device, overrides)
    translator.constraints = constraints
    k = translator.cfg.decode.nbest
    results = translator.translate_lines_nbest(lines, nbest=k)
    best = [hyps[0].text for hyps in results]
    out_lines = best if k == 1 else format_nbest(results)
    _, warning = empty_outputs(lines, best)
    if warning:
        print(warning, file=sys.stderr)
    if output is None:
        write_stdout(out_lines)
    else:
        atomic_write_lines(output, out_lines)
