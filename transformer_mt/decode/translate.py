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

import dataclasses
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sentencepiece as spm
import torch
import yaml
from tqdm import tqdm

from transformer_mt.checkpoint import Checkpoint, read_average
from transformer_mt.config import (
    Config,
    ConfigError,
    DecodeConfig,
    apply_override,
    config_from_dict,
    parse_override,
    validate,
)
from transformer_mt.data.batching import batches_by_tokens
from transformer_mt.data.bpe import EOS, PAD, load_bpe, load_bpe_bytes
from transformer_mt.data.clean import normalize, read_lines
from transformer_mt.decode.ensemble import Ensemble
from transformer_mt.decode.search import Hypothesis, beam_search, pad_batch
from transformer_mt.errors import UserError
from transformer_mt.files import atomic_write_lines
from transformer_mt.model.onednn import use_onednn_linears
from transformer_mt.model.transformer import Transformer


class TranslateError(UserError):
    """Input or checkpoint problems a user can fix; the message names the file (and line) and the fix."""


@dataclass(frozen=True)
class Translation:
    """One hypothesis: detokenized ``text``, normalized ``score`` and raw ``log_prob`` (natural log, EOS included)."""

    text: str
    score: float
    log_prob: float


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(name: str | torch.device | None, default: str | None = None) -> torch.device:
    """``--device`` as a torch device, refused here when this machine cannot run it (before any model loads).

    torch would accept ``cuda`` on a build without CUDA and fail on the
    first tensor moved, in an assertion about how it was compiled.
    """
    try:
        device = torch.device(name or default or default_device())
    except RuntimeError:
        raise TranslateError(f"--device {name}: not a device torch knows; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TranslateError(f"--device {name}: this machine has no CUDA GPU that torch can use; use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise TranslateError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA GPU(s), from cuda:0")
    return device


def load_state(paths: Sequence[Path]) -> Checkpoint:
    """The checkpoint of ``paths``, averaged by `read_average` when there are several (what `tmt average` writes).

    Config and BPE model come from the newest input (highest update); a file
    without them is refused by `read_checkpoint`, naming the file and the entry.
    """
    return read_average(paths)


def override_config(cfg: Config, overrides: Sequence[str]) -> Config:
    """``cfg`` with ``--set section.key=value`` overrides applied: only ``decode.*`` and ``model.max_positions``.

    Every other key is fixed by the trained weights or the data they were
    trained on. Sinusoidal positions are computed, not stored, so a trained
    model accepts any ``max_positions``; learned positions cannot change.
    """
    for text in overrides:
        section, key, _ = parse_override(text)
        if section != "decode" and f"{section}.{key}" != "model.max_positions":
            raise ConfigError(
                f"--set {text}: a trained checkpoint only takes decode.* keys and model.max_positions; "
                "the other keys are fixed by its weights"
            )
        changed = apply_override(cfg, text)
        if changed.model.max_positions != cfg.model.max_positions and cfg.model.positions == "learned":
            raise ConfigError(
                f"--set {text}: this checkpoint has learned positions (one trained vector per position), so "
                f"model.max_positions stays {cfg.model.max_positions}"
            )
        cfg = changed
    validate(cfg)
    return cfg


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
        self.search = self._beam_search if search is None else search

    @classmethod
    def from_checkpoints(
        cls,
        paths: Sequence[str | Path],
        device: str | torch.device | None = None,
        beam: int | None = None,
        lenpen: float | None = None,
        nbest: int | None = None,
        batch_tokens: int | None = None,
        overrides: Sequence[str] = (),
        ensemble: bool = False,
    ) -> Translator:
        """Load one checkpoint; several are averaged on the fly (`read_average`, exactly as `tmt average` does),
        or with ``ensemble`` decoded together, each model whole (`load_ensemble`).

        Decoding settings come from the config stored in the (newest; with
        ``ensemble``, the first) checkpoint, then ``overrides`` (``--set``
        texts, see `override_config`), then the arguments that are not None.
        """
        paths = [Path(p) for p in paths]
        if not paths:
            raise TranslateError("no checkpoint given; pass one or more with -c CHECKPOINT")
        device = resolve_device(device)
        if ensemble and len(paths) > 1:
            models, cfg, spm_model = load_ensemble(paths, overrides, device)
            model: Transformer | Ensemble = Ensemble(models)
        else:
            ck = load_state(paths)
            cfg, spm_model = _checkpoint_config(ck, paths, overrides), ck.spm_model
            model = _load_model(ck, cfg, paths[0], device)
        return cls(model, load_bpe_bytes(spm_model), set_decode(cfg, beam, lenpen, nbest, batch_tokens), device)

    @classmethod
    def from_ctranslate2(
        cls,
        paths: Sequence[str | Path],
        device: str | torch.device | None = None,
        overrides: Sequence[str] = (),
        **flags: Any,
    ) -> Translator:
        """A directory of `tmt export ctranslate2`, searched by CTranslate2 (`decode.ctranslate2_engine`).

        Settings as in `from_checkpoints` (``flags``: beam, lenpen, nbest,
        batch_tokens), from the exported config; its position table is fixed.
        """
        from transformer_mt.decode.ctranslate2_engine import (
            SPM_MODEL,
            CTranslate2Error,
            CTranslate2Search,
            model_directory,
        )

        try:
            directory = model_directory(paths)
            cfg = set_decode(_exported_config(directory, overrides), **flags)
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

    def _beam_search(self, sources: list[list[int]], nbest: int) -> list[list[Hypothesis]]:
        """tmt's own search, `beam_search` over ``self.model`` with the decode section's settings."""
        d = self.cfg.decode
        return beam_search(
            self.model, pad_batch(sources).to(self.device), beam_size=d.beam_size, len_penalty=d.len_penalty,
            len_penalty_form=d.len_penalty_form, max_len_a=d.max_len_a, max_len_b=d.max_len_b, nbest=nbest,
            max_positions=self.cfg.model.max_positions, no_repeat_ngram=d.no_repeat_ngram, stopping=d.stopping,
        )  # fmt: skip


def set_decode(
    cfg: Config,
    beam: int | None = None,
    lenpen: float | None = None,
    nbest: int | None = None,
    batch_tokens: int | None = None,
) -> Config:
    """``cfg`` with the decoding flags of translate/evaluate that are not None (after ``--set``)."""
    return dataclasses.replace(cfg, decode=_override(cfg.decode, beam, lenpen, nbest, batch_tokens))


def _override(
    d: DecodeConfig, beam: int | None, lenpen: float | None, nbest: int | None, batch_tokens: int | None
) -> DecodeConfig:
    changes = {"beam_size": beam, "len_penalty": lenpen, "nbest": nbest, "batch_tokens": batch_tokens}
    d = dataclasses.replace(d, **{k: v for k, v in changes.items() if v is not None})
    if nbest is None and beam is not None:
        d = dataclasses.replace(d, nbest=min(d.nbest, d.beam_size))  # a smaller --beam also shortens the saved n-best
    for flag, value in (("--beam", d.beam_size), ("--batch-tokens", d.batch_tokens), ("--nbest", d.nbest)):
        if value < 1:
            raise TranslateError(f"{flag} must be at least 1, got {value}")
    if d.nbest > d.beam_size:
        raise TranslateError(f"--nbest {d.nbest} cannot exceed the beam size ({d.beam_size}); raise --beam")
    return d


def load_ensemble(
    paths: Sequence[Path], overrides: Sequence[str], device: torch.device
) -> tuple[list[Transformer], Config, bytes]:
    """The models of ``paths``, each whole, for an `Ensemble`; the config to decode with; their BPE model.

    Every checkpoint must hold the same BPE model: the ensemble averages the
    models' log-probabilities token id by token id. Each model keeps its own
    shape. Decoding settings are the first checkpoint's (and ``overrides``,
    applied to each); the longest input is the smallest model.max_positions.
    """
    checkpoints = [load_state([path]) for path in paths]
    for path, ck in zip(paths[1:], checkpoints[1:], strict=True):
        if ck.spm_model != checkpoints[0].spm_model:
            raise TranslateError(
                f"{path}: a different BPE model (vocabulary) than {paths[0]}; an ensemble averages the models' "
                "log-probabilities token by token, so its models must share one vocabulary: ensemble models "
                "trained on the same prepared data (data.dir)"
            )
    configs = [_checkpoint_config(ck, [path], overrides) for path, ck in zip(paths, checkpoints, strict=True)]
    first = configs[0]
    positions = min(c.model.max_positions for c in configs)
    cfg = dataclasses.replace(first, model=dataclasses.replace(first.model, max_positions=positions))
    models = [
        _load_model(ck, dataclasses.replace(c, decode=first.decode), path, device)
        for path, ck, c in zip(paths, checkpoints, configs, strict=True)
    ]
    return models, cfg, checkpoints[0].spm_model


def _checkpoint_config(ck: Checkpoint, paths: Sequence[Path], overrides: Sequence[str]) -> Config:
    """The config stored in ``ck`` with ``--set`` ``overrides``; a mistake is a ConfigError naming ``paths``."""
    return override_config(config_from_dict(ck.config, origin=", ".join(map(str, paths))), overrides)


def _load_model(ck: Checkpoint, cfg: Config, path: Path, device: torch.device) -> Transformer:
    """The model of ``ck`` as ``cfg`` describes it, on ``device``; int8 when ``decode.quantize`` says so, and
    in fp32 on the CPU with oneDNN's Linear layers (`transformer_mt.model.onednn`)."""
    model = _build_model(cfg, ck.model, load_bpe_bytes(ck.spm_model), path).to(device)
    return _quantize_int8(model) if cfg.decode.quantize == "int8" else use_onednn_linears(model)


def _build_model(
    cfg: Config, params: dict[str, torch.Tensor], bpe: spm.SentencePieceProcessor, path: Path
) -> Transformer:
    vocab = bpe.get_piece_size()
    model = Transformer(cfg.model, vocab, pad_id=PAD)
    try:
        model.load_state_dict(params)
    except RuntimeError as err:
        first = str(err).splitlines()[1].strip() if len(str(err).splitlines()) > 1 else str(err)
        raise TranslateError(
            f"{path}: the weights do not fit the model its config describes (vocabulary {vocab}): {first}"
        ) from None
    return model


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


def _quantize_int8(model: Transformer) -> Transformer:
    """`decode.quantize: int8`: the int8 copy of `transformer_mt.model.quantize` (CPU only)."""
    from transformer_mt.model.quantize import quantize_int8

    return quantize_int8(model)


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
    paths: Sequence[str | Path], engine: str = "pytorch", ensemble: bool = False, **settings: Any
) -> Translator:
    """tmt's own model from checkpoints (``pytorch``), or a `tmt export ctranslate2` directory (``ctranslate2``).

    ``ensemble``: several checkpoints decode together instead of being
    averaged (tmt's search only). ``settings`` are those of
    `Translator.from_checkpoints` (device, beam, lenpen, nbest, batch_tokens, overrides).
    """
    if engine == "ctranslate2":
        if ensemble:
            raise TranslateError(
                "--ensemble runs tmt's own search over tmt checkpoints (--engine pytorch); --engine ctranslate2 "
                "decodes one exported model"
            )
        return Translator.from_ctranslate2(paths, **settings)
    if engine != "pytorch":
        raise TranslateError(f"--engine {engine!r} is not one of {', '.join(ENGINES)}")
    return Translator.from_checkpoints(paths, ensemble=ensemble, **settings)


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
    beam: int | None = None,
    lenpen: float | None = None,
    nbest: int | None = None,
    batch_tokens: int | None = None,
    device: str | None = None,
    overrides: Sequence[str] = (),
    engine: str = "pytorch",
    ensemble: bool = False,
) -> None:
    """Translate ``input`` (stdin when None) to ``output`` (stdout when None), read whole and batched by length.

    The input is read before the model loads, so bad input fails fast. See
    `tmt translate --help`; `transformer_mt.decode.stream` translates as lines arrive instead.
    """
    lines = read_input_lines(input)
    translator = load_translator(
        checkpoints, engine, ensemble=ensemble, device=device, beam=beam, lenpen=lenpen, nbest=nbest,
        batch_tokens=batch_tokens, overrides=overrides,
    )  # fmt: skip
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
