"""Helpers shared by the training tests: a run's config and its metric records.

Fixtures live in conftest.py (``prepared_toy``, ``one_thread``, ...); these are plain functions, imported as
``from helpers import run_config, metric_records`` (pytest puts this directory on the import path).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from transformer_mt.config import Config
from transformer_mt.run_names import METRICS_NAME


def run_config(cfg: Config, save_dir: str | Path, **train: Any) -> Config:
    """``cfg`` training into ``save_dir`` on one thread (tiny matrices: two threads spin-waiting against other
    processes on a busy 2-core machine are about 5x slower), with ``train`` keys set over it."""
    train = {"num_threads": 1, **train}
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, save_dir=str(save_dir), **train))


def metric_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of the run's metrics.jsonl, in file order, each line parsed strictly: a test must fail on a
    malformed line, which `transformer_mt.runs.read_metrics` (for users' runs, crashed ones included) passes over."""
    return [json.loads(line) for line in (Path(run_dir) / METRICS_NAME).read_text(encoding="utf-8").splitlines()]
