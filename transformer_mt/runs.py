"""A finished (or running) run directory, read back: what `tmt report` and `tmt plot` show.

Only files that `tmt train` and `tmt evaluate` write are read: ``config.yaml``,
``metrics.jsonl`` (records by ``kind``: ``start``, ``train``, ``valid``,
``warning``, ``end``; see `transformer_mt.train.run_files`) and the
``scores.json`` of each evaluation output directory inside the run directory
(``eval_<testset>`` by default), by the text it scored: its ``corpus``, so
that ``tmt evaluate test`` of a config whose ``data.test`` is
``.../newstest2014`` counts as newstest2014. Nothing is recomputed from
checkpoints, so a report of a 300k-update run reads a few kilobytes.

The records are spelled here, once, as dataclasses (`StartRecord`,
`TrainRecord`, `ValidRecord`, `WarningRecord`, `EndRecord`): the trainer
builds them and writes ``record.to_dict()``, so writer and reader agree on
every key. A figure that is None (no MFU without a known peak, no BLEU
without train.valid_bleu_sentences) is left out of the line.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import yaml

from transformer_mt.config import Config, ConfigError, config_from_dict
from transformer_mt.errors import UserError
from transformer_mt.run_names import CONFIG_NAME, METRICS_NAME, SCORES_NAME


class RunError(UserError):
    """A directory that is not a readable run; the message names the file and what to pass instead."""


@dataclass
class Record:
    """One line of metrics.jsonl; ``KIND`` is its ``kind`` key."""

    KIND: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of the line: ``kind`` first, then every field that is not None, in field order."""
        return {"kind": self.KIND, **{k: v for k, v in asdict(self).items() if v is not None}}


@dataclass
class StartRecord(Record):
    """Each time a process starts or resumes the run: what its training cost and hardware are computed from."""

    KIND: ClassVar[str] = "start"
    update: int
    parameters: int
    vocab_size: int
    flops_per_token: float  # model FLOPs per target token, forward and backward (`flops_per_token`)
    mean_src_tokens: float
    mean_tgt_tokens: float
    device: str
    world_size: int
    precision: str


@dataclass
class TrainRecord(Record):
    """Every train.log_every updates: the window of updates since the last one, averaged (nats per target token)."""

    KIND: ClassVar[str] = "train"
    update: int
    epoch: int
    loss: float  # label-smoothed
    nll: float
    ppl: float
    lr: float  # of the last update
    gnorm: float  # mean gradient norm over the window's updates
    tgt_tokens_per_update: float
    tgt_tokens_per_s: float
    minutes: float  # the run's wall clock, resumes included
    progress: float  # through the budget, 0..1
    model_tflops: float
    mfu: float | None = None  # only where the device's peak is known
    compiled_graphs: int | None = None  # only with train.compile: graphs torch.compile built so far


@dataclass
class ValidRecord(Record):
    """Each validation: loss, NLL and perplexity per target token, and with train.valid_bleu_sentences BLEU."""

    KIND: ClassVar[str] = "valid"
    update: int
    epoch: int
    loss: float
    nll: float
    ppl: float
    best_loss: float
    minutes: float
    bleu: float | None = None
    bleu_sentences: int | None = None
    empty_hypotheses: int | None = None
    bleu_seconds: float | None = None
    best_bleu: float | None = None
    # data.directions: each direction's figures ({"en-de": {"loss": ..., "nll": ..., "ppl": ..., "bleu": ...}});
    # loss, nll and bleu above are then their means
    directions: dict[str, dict[str, float]] | None = None


@dataclass
class WarningRecord(Record):
    """A warning the run printed, by ``reason`` (``warmup``, ``unconverged``, ``emulated_bf16``,
    ``collapsed_encoder``)."""

    KIND: ClassVar[str] = "warning"
    update: int
    reason: str
    message: str


@dataclass
class EndRecord(Record):
    """Where and why the run stopped; ``minutes`` is its final checkpoint's, where a resume goes on."""

    KIND: ClassVar[str] = "end"
    update: int
    epoch: int
    minutes: float
    stop_reason: str


@dataclass
class Run:
    """One run directory: its config, its metric records by kind, and its evaluations by test set."""

    path: Path
    cfg: Config
    records: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # kind -> records, in file order
    scores: dict[str, dict[str, Any]] = field(default_factory=dict)  # corpus -> scores.json, newest kept

    def kind(self, name: str) -> list[dict[str, Any]]:
        """The records of one kind (``train``, ``valid``, ...), in the order training wrote them."""
        return self.records.get(name, [])

    @property
    def start(self) -> dict[str, Any] | None:
        """The last ``start`` record (each resume writes one): parameters, FLOPs per token, device."""
        return (self.kind("start") or [None])[-1]

    @property
    def updates(self) -> int:
        """Updates trained: from the ``end`` record, else the last record that has an update."""
        found = [r["update"] for r in self.kind("end") + self.kind("train") + self.kind("valid")]
        return max(found, default=0)

    @property
    def minutes(self) -> float | None:
        """Wall-clock training minutes (resumes included), from the last record that carries them."""
        timed = [r for r in self.kind("end") + self.kind("train") + self.kind("valid") if "minutes" in r]
        return max((r["minutes"] for r in timed), default=None)

    @property
    def tokens_per_update(self) -> float | None:
        """Mean target tokens per update over the logged windows (each ``train`` record averages its window)."""
        windows = [r["tgt_tokens_per_update"] for r in self.kind("train") if "tgt_tokens_per_update" in r]
        return sum(windows) / len(windows) if windows else None

    @property
    def training_flops(self) -> float | None:
        """Model FLOPs spent training: updates x target tokens per update x FLOPs per target token."""
        flops = (self.start or {}).get("flops_per_token")
        tokens = self.tokens_per_update
        return None if flops is None or tokens is None else self.updates * tokens * flops

    @property
    def dev_ppl(self) -> float | None:
        """Perplexity per BPE token on the validation split at the last validation (the model the run ends with)."""
        valid = self.kind("valid")
        return valid[-1]["ppl"] if valid else None


def read_run(path: str | Path) -> Run:
    """Read a run directory (``train.save_dir`` of `tmt train`); RunError when it holds no config.yaml."""
    path = Path(path)
    config = path / CONFIG_NAME
    if not config.is_file():
        raise RunError(
            f"{path}: no config.yaml, so not a run directory of `tmt train`; pass the train.save_dir of a run "
            "(for example runs/wmt14_en_de_base or quickstart/run)"
        )
    try:
        cfg = config_from_dict(yaml.safe_load(config.read_text(encoding="utf-8")) or {}, origin=str(config))
    except (ConfigError, yaml.YAMLError) as err:
        raise RunError(f"{config}: not a config `tmt train` wrote ({err})") from None
    return Run(path, cfg, read_metrics(path / METRICS_NAME), read_scores(path))


def read_metrics(path: Path) -> dict[str, list[dict[str, Any]]]:
    """metrics.jsonl as records by kind; a line cut short by a crash is passed over, a missing file is empty."""
    records: dict[str, list[dict[str, Any]]] = {}
    if not path.is_file():
        return records
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not (isinstance(record, dict) and "kind" in record):
            continue
        problem = record_problem(record)
        if problem is not None:
            print(f"warning: {path}: line {number}: {problem}; the record is passed over", file=sys.stderr)
            continue
        records.setdefault(str(record["kind"]), []).append(record)
    return records


RECORDS = {kind.KIND: kind for kind in (StartRecord, TrainRecord, ValidRecord, WarningRecord, EndRecord)}


def record_problem(record: dict[str, Any]) -> str | None:
    """Why a metrics record of a known kind cannot be read (a field of the wrong type: a string where a number
    belongs), or None. A field it lacks is no problem (runs of older versions wrote fewer); records of other
    kinds are kept as they are."""
    kind = RECORDS.get(record["kind"])
    if kind is None:
        return None
    for f in fields(kind):
        value, hint = record.get(f.name), str(f.type)
        if value is None:
            continue
        if hint.startswith("dict"):
            if not isinstance(value, dict):
                return f"a {kind.KIND!r} record whose {f.name!r} is {value!r}, not a mapping"
            continue
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if ("float" in hint or "int" in hint) and not number:
            return f"a {kind.KIND!r} record whose {f.name!r} is {value!r}, not a number"
        if hint == "str" and not isinstance(value, str):
            return f"a {kind.KIND!r} record whose {f.name!r} is {value!r}, not a string"
    return None


def read_scores(run_dir: Path) -> dict[str, dict[str, Any]]:
    """The scores.json of each evaluation directory in ``run_dir`` by the corpus scored (the newest file per corpus).

    The corpus is the test set's name, or for ``tmt evaluate test|valid`` the
    name of the config's split file; files written before evaluate recorded
    it count under their ``testset``.
    """
    found: dict[str, tuple[float, dict[str, Any]]] = {}
    for path in run_dir.glob(f"*/{SCORES_NAME}"):
        try:
            scores = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(scores, dict) or "testset" not in scores:
            continue
        mtime, corpus = path.stat().st_mtime, str(scores.get("corpus") or scores["testset"])
        if corpus not in found or mtime > found[corpus][0]:
            found[corpus] = (mtime, {**scores, "path": str(path)})
    return {name: scores for name, (_, scores) in found.items()}
