"""Typed configuration: one dataclass per section, loaded from YAML.

Precedence is dataclass defaults < YAML file (and the files it inherits from
through ``base:``) < ``--set section.key=value`` overrides on the command line.
Every key is checked: an unknown key or a value of the wrong type is an error
that names the key, the file it came from and the nearest valid key, because a
typo that silently falls back to a default can cost a week of GPU time.

The defaults of the model, train and decode sections are the paper's settings
(Vaswani et al., 2017, base model); every deviation from the paper is a named
key whose default keeps the paper's behaviour.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from transformer_mt.errors import UserError, shown
from transformer_mt.files import atomic_write_text


class ConfigError(UserError):
    """A configuration problem a user can fix; the message says how."""


PenaltyForm = Literal["gnmt", "fairseq"]  # gnmt: ((5+len)/6)^alpha (the paper's); fairseq: len^alpha
Stopping = Literal["exact", "k_finished"]  # decode.stopping, see DecodeConfig


@dataclass
class CorpusConfig:
    """One direction with files of its own: an entry of ``data.corpora``, e.g. ``{direction: en-fr, train:
    data/europarl/train}`` reads ``data/europarl/train.en`` and ``.fr``."""

    direction: str = ""  # source-target, the files' suffixes (en-fr)
    train: str = ""  # prefix of its training files
    valid: str = ""  # prefix of its validation files; "": data.valid's files of its two languages
    test: str = ""  # prefix of its test files; "": data.test's
    weight: float = 1.0  # multiplies its share of each epoch (see data.temperature)
    synthetic: bool = False  # a model's translations (tmt backtranslate, tmt distill): trained beside its direction's
    # real pairs, not a direction of its own; counted apart by data-stats; train files only
    tag: bool = False  # synthetic only: its sources start with <BT> (tagged back-translation, Caswell et al. 2019)


@dataclass
class DataConfig:
    """Where the parallel text is and how it is cleaned.

    Parallel files are named fairseq-style: ``train: corpus/train`` with
    ``src_lang: en`` and ``tgt_lang: de`` reads ``corpus/train.en`` and
    ``corpus/train.de``. Relative paths are relative to the working directory.
    """

    train: str = "data/wmt14_en_de/train"  # prefix of the training files
    valid: str = "data/wmt14_en_de/newstest2013"  # prefix of the validation files
    test: str = "data/wmt14_en_de/newstest2014"  # prefix of the test files ("" for none)
    src_lang: str = "en"
    tgt_lang: str = "de"
    dir: str = "prepared/wmt14_en_de"  # where `tmt prepare` writes BPE model and binarized splits
    max_len: int = 250  # drop training pairs with more whitespace tokens on either side
    max_ratio: float = 1.5  # drop training pairs whose length ratio exceeds this (Moses clean-corpus)
    # Several languages in one model: "src-tgt" directions (e.g. [en-de, de-en, en-fr]) read from the train, valid
    # and test prefixes as multi-way parallel files ({prefix}.en, {prefix}.de, {prefix}.fr: line N of each is the
    # same sentence); each source gets a token naming its target language (<2de>). [] (the default): the one pair
    # src_lang -> tgt_lang, as the paper. With directions, src_lang and tgt_lang are not read.
    directions: list[str] = field(default_factory=list)
    # With directions: each epoch draws from direction i in proportion to n_i^(1/temperature) (n_i: its training
    # pairs; Arivazhagan et al. 2019); 1: in proportion to the data, larger: closer to uniform
    temperature: float = 1.0
    # Directions with files of their own, beside or instead of data.directions: [{direction: en-fr, train: PREFIX,
    # valid: PREFIX, test: PREFIX, weight: 1.0}, ...]; an empty valid or test: data.valid's or data.test's files
    corpora: list[CorpusConfig] = field(default_factory=list)
    synth: bool = False  # generate the embedded toy corpus at the `train` prefix when it is missing
    synth_pairs: int = 50_000  # training pairs of the generated toy corpus
    workers: int = 0  # encoding processes; 0 means one per CPU core


@dataclass
class BpeConfig:
    """The joint sentencepiece BPE vocabulary shared by source and target.

    ``model`` reuses an existing sentencepiece model instead of learning one,
    so that new data gets the vocabulary a checkpoint was trained with
    (fine-tuning on another corpus); the other keys but ``sampling_alpha`` only
    shape a learned model and are then ignored.
    """

    model: str = ""  # an existing spm.model to encode with (e.g. from `tmt export spm`); "": learn one from data.train
    vocab_size: int = 37_000  # the paper: about 37k joint BPE for en-de
    sample_sentences: int = 4_000_000  # sentences (both sides together) sampled to learn BPE
    character_coverage: float = 1.0
    seed: int = 1
    # Deviation (off by default, as in the paper's fixed BPE): subword regularization (Kudo 2018), which for a BPE
    # model is BPE-dropout (Provilkov et al. 2020) with this dropout probability (e.g. 0.1). Each epoch re-encodes
    # the training text (kept in data.dir by prepare) with merges dropped at random, seeded by (train.seed, epoch);
    # validation, test and decoding keep the deterministic encoding. 0: off, the prepared ids are trained on
    sampling_alpha: float = 0.0


@dataclass
class ModelConfig:
    """The Transformer; defaults are the paper's base model."""

    d_model: int = 512
    d_ff: int = 2048
    heads: int = 8
    d_k: int = 0  # query/key width per head; 0: d_model/heads (the paper's). Table 3 row B sets it alone
    encoder_layers: int = 6
    decoder_layers: int = 6
    dropout: float = 0.1  # the paper's P_drop: residual and embedding dropout
    attention_dropout: float = 0.0  # deviation: dropout on attention weights (paper: none)
    activation_dropout: float = 0.0  # deviation: dropout inside the FFN (paper: none)
    positions: Literal["sinusoidal", "learned"] = "sinusoidal"  # "learned" is Table 3 row E
    norm: Literal["post", "pre"] = "post"  # "pre" is a deviation: LayerNorm before each sublayer
    max_positions: int = 1024  # longest sequence (tokens) the model accepts
    share_embeddings: bool = True  # tie source, target and output embeddings (shared vocabulary)
    init: Literal["fairseq", "xavier"] = "fairseq"  # weight initialization; the paper fixes none (docs/model.md)
    # Deviation (Liu et al. 2021): encoder layer N (1 = the bottom) has no residual connection around its
    # self-attention, so that the states above it are not tied to each source position; it helps zero-shot
    # directions of a multilingual model. 0: off (the paper's residual everywhere)
    encoder_no_residual_layer: int = 0


@dataclass
class TrainConfig:
    """How the model is trained; defaults are the paper's base recipe."""

    save_dir: str = "runs/base"  # run directory: checkpoints, metrics, resolved config
    init_from: str = ""  # fine-tuning: a new run starts from this checkpoint's weights (same vocabulary); "" off
    seed: int = 1
    max_tokens: int = 3125  # padded tokens per batch, counted on source and target separately
    update_freq: int = 8  # batches accumulated per update; tokens/update = max_tokens x update_freq x GPUs
    lr_scale: float = 1.0  # multiplies the paper's schedule (paper: 1.0)
    warmup: int = 4000
    schedule: Literal["inverse_sqrt", "linear", "cosine"] = "inverse_sqrt"  # decay after warmup; paper: inverse_sqrt
    lr: float = 0.0  # deviation: the peak lr itself; 0 keeps the paper's lr_scale * d_model^-0.5 * warmup^-0.5
    warmup_fraction: float = 0.0  # deviation: warmup as a fraction of the run's budget instead of `warmup` updates
    decay_fraction: float = 0.0  # deviation: linear/cosine hold the peak and decay over this last fraction only
    min_warmup: int = 0  # deviation: with warmup_fraction, warm up over at least this many updates; 0: no floor
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-9
    weight_decay: float = 0.0  # deviation: decoupled weight decay (paper: none)
    label_smoothing: float = 0.1
    clip_norm: float = 0.0  # deviation: clip gradient norm to this value; 0 disables (paper: none)
    precision: Literal["auto", "fp32", "bf16", "fp16"] = (
        "auto"  # auto: bf16 on capable GPUs, fp16 on others; on CPU bf16 with AVX512-BF16/AMX, else fp32
    )
    compile: bool = False  # torch.compile the model
    pad_to_multiple: int = 0  # pad each batch's lengths up to a multiple (8: few shapes to compile); 0 or 1: off
    max_updates: int = 100_000  # 0 disables this limit
    max_epochs: int = 0  # 0 disables this limit
    max_minutes: float = 0.0  # wall-clock training minutes, counted across resumes; 0 disables
    validate_every: int = 1000  # updates between validation runs; 0: only at the end
    # With a time budget (max_minutes), also validate each time the run's clock passes another such fraction of it
    # (0.1: at 10%, 20%, ... of max_minutes), so that a slow machine, which may never reach validate_every updates,
    # still shows its validation loss (and BLEU) as it goes. 0: off. No effect without max_minutes (the paper's).
    # Where a mark and validate_every's count meet (within a tenth of validate_every updates), one validation.
    validate_every_fraction: float = 0.1
    valid_bleu_sentences: int = 0  # each validation also translates this many valid sentences, sacreBLEU; -1 all
    valid_bleu_beam: int = 1  # beam of that translation (1: greedy, the fastest); the rest from the decode section
    best_metric: Literal["loss", "bleu"] = "loss"  # what checkpoint_best.pt and patience track; bleu needs the above
    patience: int = 0  # stop after this many validations in a row without a new best best_metric; 0 disables
    save_every_updates: int = 0  # 0 disables update-based checkpoints
    save_every_minutes: float = 10.0  # the paper wrote a checkpoint every 10 minutes; 0 disables
    keep_last: int = 20  # checkpoints kept besides the best one
    average_last: int = 5  # checkpoints `tmt average` uses by default (paper: base 5, big 20)
    snapshot_span: float = 0.0  # deviation: write average_last checkpoints evenly over this last fraction of the budget
    max_nonfinite: int = 10  # stop after this many non-finite updates in a row
    log_every: int = 100  # updates between metric lines
    num_threads: int = 0  # CPU threads for torch; 0: the CPUs this process may use (transformer_mt/cpus.py)


@dataclass
class DecodeConfig:
    """Beam search; defaults are the paper's decoding settings."""

    beam_size: int = 4
    len_penalty: float = 0.6  # alpha of the length penalty
    len_penalty_form: PenaltyForm = "gnmt"  # gnmt: ((5+len)/6)^alpha; fairseq: len^alpha
    max_len_a: float = 1.0  # max output length = max_len_a * source length + max_len_b
    max_len_b: int = 50
    batch_tokens: int = 8000  # source tokens per translation batch
    nbest: int = 1
    no_repeat_ngram: int = 0  # deviation: a hypothesis may not repeat any n-gram of this size (fairseq's); 0: off
    quantize: Literal["none", "int8"] = "none"  # deviation: int8 Linear layers, a scale per input row (CPU only)
    # exact: a sentence ends when no live hypothesis can still win (the paper's tensor2tensor); deviation
    # k_finished: it ends once k hypotheses have finished (fairseq's and CTranslate2's rule, fewer steps)
    stopping: Stopping = "exact"
    # deviation: draw each token instead of searching; "none" (the paper's beam search), "topk:K" (from the K most
    # probable tokens) or "topp:P" (from the fewest most probable tokens holding probability P); beam_size 1
    sampling: str = "none"
    sampling_temperature: float = 1.0  # the log-probabilities are divided by it before drawing (< 1: sharper)
    seed: int = 1  # with the source's token ids and the sample's number, seeds each sentence's draws
    # word alignments of each translation from the decoder's attention over the source: none, hard (Pharaoh i-j
    # pairs) or soft (per target word, the source words' probabilities); from decoder layer alignment_layer
    # (1-based; 0: the top one, which aligned best on Multi30k; fairseq takes the one below it)
    alignment: Literal["none", "hard", "soft"] = "none"
    alignment_layer: int = 0
    # a checkpoint with a word aligner trained for its model (`tmt train-aligner`, transformer_mt/decode/aligner.py)
    # aligns with it instead of the attention unless use_aligner is false; its hard links are the word pairs of
    # link probability aligner_threshold or more
    use_aligner: bool = True
    aligner_threshold: float = 0.5


@dataclass(frozen=True)
class Sampling:
    """``decode.sampling`` read: draw from the ``topk`` most probable tokens, or the nucleus of mass ``topp``."""

    kind: Literal["topk", "topp"]
    value: float  # K (a whole number) or P in (0, 1]


SAMPLING_FIX = "use topk:K (K >= 1, e.g. topk:10) or topp:P (0 < P <= 1, e.g. topp:0.9)"


def parse_sampling(text: str) -> Sampling | None:
    """``decode.sampling`` as a `Sampling`, None for "none"; a ConfigError naming the fix for anything else."""
    if text == "none":
        return None
    kind, _, value = text.partition(":")
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"decode.sampling {text!r} (--sample): {SAMPLING_FIX}, or none") from None
    if kind == "topk" and number.is_integer() and number >= 1:
        return Sampling("topk", number)
    if kind == "topp" and 0 < number <= 1:
        return Sampling("topp", number)
    raise ConfigError(f"decode.sampling {text!r} (--sample): {SAMPLING_FIX}")


@dataclass(frozen=True)
class DecodeMode:
    """What one translation request combines: the decode section's choices and the caller's own (constraints,
    prefixes, an engine, an ensemble). `mode_conflict` judges it, for the CLI, a config file and the server alike."""

    sampling: bool = False
    beam: int = 4
    nbest: int = 1
    constraints: bool = False
    prefixes: bool = False
    alignment: bool = False
    engine: str = "pytorch"  # or "ctranslate2": another engine's search
    ensemble: bool = False

    @classmethod
    def of(cls, d: DecodeConfig, nbest: int | None = None, **given: Any) -> DecodeMode:
        """The mode of the decode section ``d`` (``nbest``: the caller's, default ``d.nbest``) and ``given``."""
        sampling = d.sampling != "none"
        return cls(sampling, d.beam_size, d.nbest if nbest is None else nbest, alignment=d.alignment != "none", **given)


CLI_NAMES = {
    "sampling": "--sample", "beam": "--beam", "nbest": "--nbest", "constraints": "--constraints",
    "prefixes": "--prefix-file", "alignment": "--alignment", "engine": "--engine ctranslate2", "ensemble": "--ensemble",
    "one_beam": "pass --beam 1",
}  # fmt: skip
"""How `tmt translate` and `tmt evaluate` users spell each choice of a `DecodeMode`, for `mode_conflict`'s messages."""
CONFIG_NAMES = {**CLI_NAMES, "sampling": "decode.sampling (--sample)", "beam": "decode.beam_size (--beam)",
                "nbest": "decode.nbest (--nbest)", "one_beam": "pass --beam 1 (decode.beam_size: 1)"}  # fmt: skip
API_NAMES = {
    "sampling": "'sample'", "beam": "'beam'", "nbest": "'nbest'", "constraints": "'constraints'",
    "prefixes": "'prefixes'", "alignment": "'alignment'", "engine": "this server's CTranslate2 engine",
    "ensemble": "this server's ensemble", "one_beam": "send 'beam': 1",
}  # fmt: skip


def mode_conflict(mode: DecodeMode, names: dict[str, str] = CLI_NAMES) -> tuple[str, str] | None:
    """The first rule ``mode`` breaks, as (the choice at fault, a message spelled with ``names``), or None.

    Every rule about which decoding choices combine is here, so that the
    command line, a config file and the server's API refuse the same
    requests: a sample takes no beam; n-best within the beam (any number of
    samples); constraints need tmt's own beam search without prefixes;
    an ensemble and word alignments need tmt's own models.
    """
    n = names
    if mode.sampling and mode.beam > 1:
        return "beam", (
            f"{n['sampling']} draws one token at a time and takes no beam ({n['beam']} is {mode.beam}): "
            f"{n['one_beam']}, or drop {n['sampling']} to search with the beam; {n['nbest']} K gives K samples"
        )
    if mode.nbest < 1 or (mode.nbest > mode.beam and not mode.sampling):
        return "nbest", f"{n['nbest']} ({mode.nbest}) must be at least 1 and cannot exceed {n['beam']} ({mode.beam})"
    if mode.constraints:
        other = next((c for c in ("sampling", "prefixes") if getattr(mode, c)), None)
        if other is not None:
            return "constraints", (
                f"{n['constraints']} cannot be combined with {n[other]}: the constraints are placed by a beam "
                f"search of their own; drop {n[other]} to translate with the constraints"
            )
        if mode.engine != "pytorch":
            return "constraints", (
                f"{n['constraints']} needs tmt's own search (--engine pytorch): CTranslate2 has no lexical "
                "constraints; translate with the checkpoint the export came from"
            )
    if mode.ensemble and mode.engine != "pytorch":
        return "ensemble", (
            f"{n['ensemble']} runs tmt's own search over tmt checkpoints (--engine pytorch); {n['engine']} decodes "
            "one exported model"
        )
    if mode.alignment and (mode.ensemble or mode.engine != "pytorch"):
        return "alignment", (
            f"{n['alignment']} reads the attention of one tmt model: use --engine pytorch with one checkpoint (or "
            "several averaged, without --ensemble)"
        )
    return None


@dataclass
class Config:
    """The whole configuration of a run."""

    data: DataConfig = field(default_factory=DataConfig)
    bpe: BpeConfig = field(default_factory=BpeConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


_SECTION_TYPES = typing.get_type_hints(Config)


def _nearest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(options)}"


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Return ``value`` as type ``hint`` or raise a ConfigError naming ``where``."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(f"{where}: {shown(value)} is not one of {', '.join(map(repr, choices))}")
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {shown(value)}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where}: expected an integer, got {shown(value)}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where}: expected a number, got {shown(value)}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list (e.g. [en-de, de-en]), got {shown(value)}")
        (item,) = typing.get_args(hint)
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of keys to values, got {shown(value)}")
        hints = typing.get_type_hints(hint)
        for key in value:
            if key not in hints:
                raise ConfigError(f"{where}: unknown key {shown(key)}{_nearest(str(key), list(hints))}")
        return hint(**{key: _coerce(v, hints[key], f"{where}.{key}") for key, v in value.items()})
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: expected a string, got {shown(value)}")
    raise ConfigError(f"{where}: unsupported type {hint}")


def _merge_section(section: Any, values: Any, name: str, origin: str) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{origin}: section '{name}' must be a mapping of keys to values")
    hints = typing.get_type_hints(type(section))
    changes = {}
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(f"{origin}: unknown key {shown(f'{name}.{key}')}{_nearest(str(key), list(hints))}")
        changes[key] = _coerce(value, hints[key], f"{origin}: key '{name}.{key}'")
    return dataclasses.replace(section, **changes)


def _apply(cfg: Config, raw: dict[str, Any], origin: str) -> Config:
    for name, values in raw.items():
        if name not in _SECTION_TYPES:
            raise ConfigError(f"{origin}: unknown section {shown(name)}{_nearest(str(name), list(_SECTION_TYPES))}")
        merged = _merge_section(getattr(cfg, name), values or {}, name, origin)
        cfg = dataclasses.replace(cfg, **{name: merged})
    return cfg


PACKAGED = "tmt:"  # `base: tmt:base.yaml`, `tmt train tmt:toy.yaml`: a config shipped inside the package
PACKAGED_DIR = Path(__file__).resolve().parent / "configs"


def shipped_configs() -> list[str]:
    """The names of the configs shipped with tmt, as ``tmt:NAME`` takes them (``table3/a_h1.yaml`` ...)."""
    return sorted(str(p.relative_to(PACKAGED_DIR)) for p in PACKAGED_DIR.rglob("*.yaml"))


def config_path(name: str | Path) -> Path:
    """The file a config name means: ``tmt:NAME`` is a config shipped with tmt, anything else a path.

    One rule for every path in a config, ``base:`` included: a path is
    relative to the working directory (the directory tmt runs in), as the
    data, ``data.dir`` and ``train.save_dir`` paths always were. A copied
    config therefore keeps working wherever it goes as long as it is run
    from the same place, and ``tmt:`` reaches the shipped configs from any
    directory, with or without a checkout (``pip install`` ships them).
    """
    text = str(name)
    if not text.startswith(PACKAGED):
        return Path(text)
    short = text[len(PACKAGED) :]
    path = PACKAGED_DIR / (short if short.endswith((".yaml", ".yml")) else f"{short}.yaml")
    if not path.is_file() or PACKAGED_DIR not in path.resolve().parents:
        known = ", ".join(f"tmt:{n}" for n in shipped_configs() if "/" not in n)
        raise ConfigError(f"{text}: tmt ships no such config; shipped: {known} (and tmt:table3/...)")
    return path


def _missing_base(base: str, path: Path, referrer: Path) -> ConfigError:
    """The fix for a ``base:`` that names no file; a path relative to the referring file was the old rule."""
    beside = referrer.parent / base
    if beside.is_file() and beside.resolve() != path.resolve():
        hint = (
            f"paths in a config are relative to the directory tmt runs in, not to the config file: write "
            f"base: {os.path.relpath(beside)}" + (f" or base: tmt:{base}" if (PACKAGED_DIR / base).is_file() else "")
        )
    elif (PACKAGED_DIR / base).is_file():
        hint = f"for the config shipped with tmt write base: tmt:{base}"
    else:
        hint = "fix the base: line (paths are relative to the directory tmt runs in; tmt:NAME: a shipped config)"
    return ConfigError(f"{referrer}: base: {base} not found (looked for {path}); {hint}")


def _bad_value(err: ValueError) -> str:
    """A value YAML reads but Python cannot build: a number of thousands of digits, or an impossible date."""
    if "digits" in str(err):
        return "a number of thousands of digits, which no setting takes; write the value the setting needs"
    return f"a value that cannot be read ({err}); write the value the setting needs"


def _not_text(path: Path, err: UnicodeDecodeError) -> str:
    """What a config file that is not UTF-8 text looks like: a checkpoint (a zip archive, as torch saves one), or
    other bytes."""
    with path.open("rb") as f:
        if f.read(4) == b"PK\x03\x04":
            return "a tmt checkpoint (or another zip archive), not a config: pass a checkpoint with -c"
    return (
        f"not UTF-8 text (byte {err.start} is {err.object[err.start : err.start + 1]!r}), so not a config: a config "
        "is a YAML text file, e.g. one `tmt init` wrote; save it as UTF-8"
    )


def _read_yaml(path: Path, chain: tuple[Path, ...]) -> list[tuple[dict[str, Any], str]]:
    """Read ``path`` and the files it inherits from, oldest ancestor first.

    A missing base is reported with the file whose ``base:`` names it: the
    fix is in that file.
    """
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path.resolve() in chain:
        raise ConfigError(f"{path}: 'base:' inheritance loops back to {path}")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: {_not_text(path, err)}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    except ValueError as err:  # Python's limit on an int's digits, or a date YAML cannot build (2024-13-45)
        raise ConfigError(f"{path}: {_bad_value(err)}") from None
    except RecursionError:
        raise ConfigError(
            f"{path}: values nested too deeply (hundreds of [ or {{); a config is sections of keys"
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    check_expansion(raw, str(path))
    layers: list[tuple[dict[str, Any], str]] = []
    base = raw.pop("base", None)
    if base is not None:
        base_path = config_path(str(base))
        if not base_path.is_file():
            raise _missing_base(str(base), base_path, path)
        layers = _read_yaml(base_path, chain + (path.resolve(),))
    return layers + [(raw, _origin(path))]


YAML_VALUES_MAX = 100_000  # values in a config once its aliases are expanded; a whole config holds a few hundred


def check_expansion(raw: Any, origin: str) -> None:
    """Refuse a value whose aliases expand past `YAML_VALUES_MAX` values (a "billion laughs" of a few hundred
    bytes): walking or printing it whole would take the machine's memory. Counted on the shared nodes, at once."""
    sizes: dict[int, int] = {}

    def size(node: Any) -> int:
        if not isinstance(node, (list, dict)):
            return 1
        if id(node) not in sizes:
            sizes[id(node)] = 0  # a node that holds itself counts once
            children = list(node.values()) if isinstance(node, dict) else node
            sizes[id(node)] = min(YAML_VALUES_MAX + 1, 1 + sum(size(child) for child in children))
        return sizes[id(node)]

    try:
        total = size(raw)
    except RecursionError:
        raise ConfigError(f"{origin}: values nested too deeply; a config is sections of keys to values") from None
    if total > YAML_VALUES_MAX:
        raise ConfigError(
            f"{origin}: the values expand to more than {YAML_VALUES_MAX} through YAML aliases (*name); "
            "write the values out, a config holds a few hundred"
        )


def _origin(path: Path) -> str:
    """How errors name a config file: a shipped one by its ``tmt:`` name, not its site-packages path."""
    resolved = path.resolve()
    if PACKAGED_DIR in resolved.parents:
        return f"{PACKAGED}{resolved.relative_to(PACKAGED_DIR)}"
    return str(path)


def parse_override(text: str) -> tuple[str, str, Any]:
    """Split ``section.key=value``; the value is parsed as YAML (so 3 is int, true is bool)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        key = text.split("=", 1)[0].strip()
        owners = [name for name, kind in _SECTION_TYPES.items() if key in {f.name for f in dataclasses.fields(kind)}]
        hint = f"did you mean --set {owners[0]}.{text}?" if owners else "for example --set train.max_updates=2000"
        raise ConfigError(f"--set {shown(text)}: expected section.key=value; {hint}")
    dotted, value = text.split("=", 1)
    section, key = dotted.split(".", 1)
    try:
        parsed = yaml.safe_load(value) if value != "" else ""
    except (yaml.YAMLError, RecursionError):
        parsed = value
    except ValueError as err:  # Python's limit on an int's digits, or a date YAML cannot build (2024-13-45)
        raise ConfigError(f"--set {dotted}: {_bad_value(err)}") from None
    check_expansion(parsed, f"--set {dotted}")
    return section, key, parsed


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, then the YAML file and its ``base:`` ancestors, then ``--set`` overrides."""
    cfg = Config()
    if path is not None:
        for raw, origin in _read_yaml(config_path(path), ()):
            cfg = _apply(cfg, raw, origin)
    for text in overrides:
        cfg = apply_override(cfg, text)
    validate(cfg)
    return cfg


def apply_override(cfg: Config, text: str) -> Config:
    """``cfg`` with one ``section.key=value`` applied and type-checked (not yet cross-validated)."""
    section, key, value = parse_override(text)
    return _apply(cfg, {section: {key: value}}, f"--set {text if len(text) <= 80 else text[:77] + '...'}")


def config_from_dict(raw: dict[str, Any], origin: str = "checkpoint") -> Config:
    """Rebuild a Config saved with ``Config.to_dict`` (e.g. inside a checkpoint)."""
    check_expansion(raw, origin)
    cfg = _apply(Config(), raw, origin)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Checks across keys that no single type can express."""
    _validate_data(cfg.data)
    _validate_sizes(cfg)
    m = cfg.model
    if m.d_model % m.heads:
        raise ConfigError(
            f"model.d_model ({m.d_model}) must be divisible by model.heads ({m.heads}); "
            f"try heads={_divisor_near(m.d_model, m.heads)}"
        )
    if m.d_k < 0:
        raise ConfigError(f"model.d_k must be 0 (d_model/heads = {m.d_model // m.heads}) or a width, got {m.d_k}")
    if not 0 <= m.encoder_no_residual_layer <= m.encoder_layers:
        raise ConfigError(
            f"model.encoder_no_residual_layer {m.encoder_no_residual_layer}: the model has encoder layers 1 to "
            f"{m.encoder_layers} (0: off, every layer keeps its residual connections)"
        )
    for key, p in {
        "model.dropout": m.dropout,
        "model.attention_dropout": m.attention_dropout,
        "model.activation_dropout": m.activation_dropout,
        "train.label_smoothing": cfg.train.label_smoothing,
        "bpe.sampling_alpha": cfg.bpe.sampling_alpha,
    }.items():
        if not 0.0 <= p < 1.0:
            raise ConfigError(f"{key} must be in [0, 1), got {p}")
    for key, on in (("bpe.sampling_alpha", cfg.bpe.sampling_alpha > 0), ("data.synth", cfg.data.synth)):
        if (cfg.data.directions or cfg.data.corpora) and on:  # several directions, or synthetic corpora
            raise ConfigError(
                f"{key} works with one corpus of one language pair, not yet with data.directions or data.corpora; "
                "turn it off"
            )
    _validate_schedule(cfg.train)
    _validate_optimizer(cfg)
    _validate_decode(cfg.decode)
    if cfg.train.pad_to_multiple < 0:
        raise ConfigError(
            f"train.pad_to_multiple must be 0 (off) or a multiple such as 8, got {cfg.train.pad_to_multiple}"
        )
    if cfg.decode.alignment_layer > cfg.model.decoder_layers:
        raise ConfigError(
            f"decode.alignment_layer {cfg.decode.alignment_layer}: the model has decoder layers 1 to "
            f"{cfg.model.decoder_layers} (0: the top one)"
        )
    if not cfg.train.save_dir.strip():
        raise ConfigError("train.save_dir is empty; it names the run directory, e.g. runs/my_run")
    if not (math.isfinite(cfg.train.weight_decay) and cfg.train.weight_decay >= 0):
        raise ConfigError(f"train.weight_decay must be 0 (the paper: none) or more, got {cfg.train.weight_decay}")
    for key in ("max_updates", "max_epochs"):
        if getattr(cfg.train, key) > BUDGET_MAX:
            raise ConfigError(f"train.{key} {getattr(cfg.train, key)} is past any run (at most {BUDGET_MAX:.0e})")
    if cfg.train.max_updates <= 0 and cfg.train.max_epochs <= 0 and cfg.train.max_minutes <= 0:
        raise ConfigError("training would never stop: set train.max_updates, train.max_epochs or train.max_minutes")
    _validate_validation(cfg.train)


SIZE_MAX = {
    "model.d_model": 1 << 16,
    "model.d_ff": 1 << 18,
    "model.heads": 1 << 10,
    "model.encoder_layers": 1000,
    "model.decoder_layers": 1000,
    "model.max_positions": 1 << 16,
    "bpe.vocab_size": 1 << 20,
    "decode.beam_size": 1000,
    "decode.nbest": 1000,
}  # far past any model of the paper's kind: a larger value is a typo, and would allocate until memory runs out


def _validate_sizes(cfg: Config) -> None:
    """Counts and sizes that must be positive, and those that allocate memory in proportion to themselves."""
    m = cfg.model
    positive = {
        "model.d_model": m.d_model,
        "model.d_ff": m.d_ff,
        "model.heads": m.heads,
        "model.encoder_layers": m.encoder_layers,
        "model.decoder_layers": m.decoder_layers,
        "model.max_positions": m.max_positions,
        "bpe.vocab_size": cfg.bpe.vocab_size,
        "train.max_tokens": cfg.train.max_tokens,
        "train.update_freq": cfg.train.update_freq,
        "decode.beam_size": cfg.decode.beam_size,
        "decode.batch_tokens": cfg.decode.batch_tokens,
        "decode.nbest": cfg.decode.nbest,
        "train.warmup": cfg.train.warmup,
        "train.log_every": cfg.train.log_every,
        "train.keep_last": cfg.train.keep_last,
        "train.average_last": cfg.train.average_last,
        "train.max_nonfinite": cfg.train.max_nonfinite,
    }
    if cfg.train.num_threads < 0:
        raise ConfigError(
            f"train.num_threads must be 0 (the CPUs the process may use) or more, got {cfg.train.num_threads}"
        )
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}")
        if value > SIZE_MAX.get(key, value):
            raise ConfigError(f"{key} must be at most {SIZE_MAX[key]}, got {value}")


BUDGET_MAX = 10**12  # updates or epochs: a larger count is a typo, and past what a step counter should hold
SEED_MAX = 2**32 - 1  # numpy's legacy seeding and sentencepiece take 32 bits


def _validate_optimizer(cfg: Config) -> None:
    """Values torch and numpy would accept but train wrongly with, or refuse only once training has begun."""
    tc = cfg.train
    if not (math.isfinite(tc.lr_scale) and tc.lr_scale >= 0):
        raise ConfigError(f"train.lr_scale must be a number, 0 or more (the paper: 1.0), got {tc.lr_scale}")
    if not math.isfinite(tc.lr):
        raise ConfigError(f"train.lr must be a number (or 0 for the paper's peak), got {tc.lr}")
    for key, beta in (("train.adam_beta1", tc.adam_beta1), ("train.adam_beta2", tc.adam_beta2)):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"{key} must be in [0, 1) (the paper: 0.9 and 0.98), got {beta}")
    if not (math.isfinite(tc.adam_eps) and tc.adam_eps > 0):
        raise ConfigError(f"train.adam_eps must be a small positive number (the paper: 1e-9), got {tc.adam_eps}")
    for key, seed in (("train.seed", tc.seed), ("bpe.seed", cfg.bpe.seed)):
        if not 0 <= seed <= SEED_MAX:
            raise ConfigError(f"{key} must be an integer from 0 to {SEED_MAX}, got {seed}")


def _validate_decode(d: DecodeConfig) -> None:
    """The longest output, max_len_a x source length + max_len_b, and the n-gram size cannot be negative."""
    if not (math.isfinite(d.max_len_a) and d.max_len_a >= 0):
        raise ConfigError(f"decode.max_len_a must be 0 or more (the paper: 1), got {d.max_len_a}")
    if not math.isfinite(d.len_penalty):
        raise ConfigError(f"decode.len_penalty must be a number (the paper: 0.6; 0: none), got {d.len_penalty}")
    if d.max_len_b < 0:
        raise ConfigError(f"decode.max_len_b must be 0 or more (the paper: 50), got {d.max_len_b}")
    if d.no_repeat_ngram < 0:
        raise ConfigError(
            f"decode.no_repeat_ngram must be 0 (off, the paper) or an n-gram size, got {d.no_repeat_ngram}"
        )
    _validate_sampling(d)
    if not 0.0 < d.aligner_threshold <= 1.0:
        raise ConfigError(f"decode.aligner_threshold is a link probability in (0, 1], got {d.aligner_threshold}")
    if d.alignment_layer < 0:
        raise ConfigError(
            f"decode.alignment_layer must be 0 (the top layer) or a decoder layer from 1, got {d.alignment_layer}"
        )


def _validate_sampling(d: DecodeConfig) -> None:
    """A sampling setting that reads, a mode that combines (`mode_conflict`: a sample takes no beam, n-best
    within the beam); a temperature above 0."""
    parse_sampling(d.sampling)
    conflict = mode_conflict(DecodeMode.of(d), CONFIG_NAMES)
    if conflict is not None:
        raise ConfigError(conflict[1])
    if not (math.isfinite(d.sampling_temperature) and d.sampling_temperature > 0):
        raise ConfigError(
            f"--temperature (decode.sampling_temperature) must be above 0 (1: the model's own distribution), "
            f"got {d.sampling_temperature}"
        )
    if not 0 <= d.seed <= SEED_MAX:
        raise ConfigError(f"--seed (decode.seed) must be an integer from 0 to {SEED_MAX}, got {d.seed}")


def _validate_data(d: DataConfig) -> None:
    """The training and validation prefixes are required; an empty data.test means no test split. Directions
    read "src-tgt" with two different language codes, each once."""
    for key in ("train", "valid"):
        if not getattr(d, key):
            raise ConfigError(f"data.{key} is empty; it must name the {key} files' prefix (only data.test may be '')")
    for text in d.directions:
        _check_direction(text, "data.directions")
    for i, corpus in enumerate(d.corpora):
        _validate_corpus(corpus, f"data.corpora[{i}]")
    every = [*d.directions, *(c.direction for c in d.corpora if not c.synthetic)]
    if len(set(every)) != len(every):
        twice = next(x for x in every if every.count(x) > 1)
        raise ConfigError(f"{twice} is listed twice (data.directions, data.corpora); list each direction once")
    trained = every or [f"{d.src_lang}-{d.tgt_lang}"]
    for i, corpus in enumerate(d.corpora):
        if corpus.synthetic and corpus.direction not in trained:
            raise ConfigError(
                f"data.corpora[{i}]: a synthetic corpus of {corpus.direction}, which the model does not train "
                f"({', '.join(trained)}); give it one of those directions"
            )
    if not (math.isfinite(d.temperature) and d.temperature > 0):
        raise ConfigError(f"data.temperature must be above 0 (1: in proportion to the data), got {d.temperature}")


def _validate_corpus(corpus: CorpusConfig, where: str) -> None:
    _check_direction(corpus.direction, f"{where}.direction")
    if not corpus.train:
        raise ConfigError(f"{where}.train is empty; it must name the prefix of {corpus.direction}'s training files")
    if not (math.isfinite(corpus.weight) and corpus.weight > 0):
        raise ConfigError(f"{where}.weight must be above 0 (1: its share by size alone), got {corpus.weight}")
    if corpus.synthetic and (corpus.valid or corpus.test):
        raise ConfigError(
            f"{where}: a synthetic corpus trains only; validate and test on real text (drop its valid and test)"
        )
    if corpus.tag and not corpus.synthetic:
        raise ConfigError(f"{where}.tag marks synthetic sources (<BT>); set synthetic: true too, or drop tag")


def _check_direction(text: str, where: str) -> None:
    src, sep, tgt = text.partition("-")
    if not (sep and LANG_CODE.fullmatch(src) and LANG_CODE.fullmatch(tgt)) or src == tgt:
        raise ConfigError(
            f"{where}: {shown(text)} is not a direction; write source-target with two different language codes, the "
            "files' suffixes (e.g. en-de)"
        )


LANG_CODE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,15}")  # a language code as file suffixes spell it: en, zh_Hant


def _validate_validation(tc: TrainConfig) -> None:
    """How often to validate and save, validation BLEU, the best checkpoint's metric and patience."""
    for key, what in (("validate_every", "validate only at the end"), ("save_every_updates", "off")):
        if getattr(tc, key) < 0:
            raise ConfigError(f"train.{key} must be 0 ({what}) or a number of updates, got {getattr(tc, key)}")
    if tc.valid_bleu_sentences < -1:
        raise ConfigError(
            f"train.valid_bleu_sentences must be -1 (all), 0 (off) or a number of sentences, "
            f"got {tc.valid_bleu_sentences}"
        )
    if tc.valid_bleu_beam < 1:
        raise ConfigError(f"train.valid_bleu_beam must be at least 1 (1 is greedy), got {tc.valid_bleu_beam}")
    if tc.best_metric == "bleu" and tc.valid_bleu_sentences == 0:
        raise ConfigError(
            "train.best_metric=bleu needs a validation BLEU: set train.valid_bleu_sentences (e.g. 500, or -1 for "
            "the whole validation split)"
        )
    if tc.patience < 0:
        raise ConfigError(f"train.patience must be 0 (off) or a number of validations, got {tc.patience}")
    if tc.patience > 0 and tc.validate_every <= 0:
        raise ConfigError(
            f"train.patience={tc.patience} counts validations, but train.validate_every={tc.validate_every} "
            "validates only at the end; set train.validate_every"
        )


def _validate_schedule(tc: TrainConfig) -> None:
    fractions = {
        "train.warmup_fraction": tc.warmup_fraction,
        "train.decay_fraction": tc.decay_fraction,
        "train.snapshot_span": tc.snapshot_span,
        "train.validate_every_fraction": tc.validate_every_fraction,
    }
    for key, value in fractions.items():
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{key} must be in [0, 1), got {value}")
    if tc.lr < 0:
        raise ConfigError(f"train.lr must be positive (or 0 for the paper's peak), got {tc.lr}")
    if tc.lr > 0 and tc.lr_scale != 1.0:
        raise ConfigError(
            f"train.lr={tc.lr} sets the peak learning rate itself, so train.lr_scale={tc.lr_scale} would be ignored; "
            "set train.lr_scale=1.0 (or train.lr=0 to scale the paper's schedule)"
        )
    if tc.decay_fraction > 0 and tc.schedule == "inverse_sqrt":
        raise ConfigError("train.decay_fraction applies to train.schedule=linear or cosine, not inverse_sqrt")
    if tc.min_warmup < 0:
        raise ConfigError(f"train.min_warmup must be 0 (no floor) or a number of updates, got {tc.min_warmup}")
    if tc.min_warmup > 0 and tc.warmup_fraction == 0:
        raise ConfigError(
            "train.min_warmup is a floor under train.warmup_fraction; with a warmup in updates, set train.warmup"
        )
    if tc.warmup_fraction > 0 and tc.lr == 0:
        raise ConfigError(
            "train.warmup_fraction needs a peak learning rate: the paper's peak depends on train.warmup in updates; "
            "set train.lr (e.g. --set train.lr=0.001)"
        )


def _divisor_near(n: int, k: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: abs(d - k))


def field_differences(a: Any, b: Any, prefix: str = "") -> str:
    """The fields in which two dataclasses of one type differ, as ``prefix.name a ≠ b`` joined by commas."""
    return ", ".join(
        f"{prefix}{f.name} {getattr(a, f.name)} ≠ {getattr(b, f.name)}"
        for f in dataclasses.fields(a)
        if getattr(a, f.name) != getattr(b, f.name)
    )


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as YAML next to a run's outputs, whole or not at all."""
    atomic_write_text(path, cfg.to_yaml())


def config_hash(section: Any) -> str:
    """A stable hash of a config section (or a dict of its values), used to tell whether prepared data is stale."""
    import hashlib

    values = section if isinstance(section, dict) else dataclasses.asdict(section)
    text = json.dumps(values, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
