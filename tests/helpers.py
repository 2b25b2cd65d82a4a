"""Helpers shared by the tests: a run's config, its metric records, a tiny random-weight Transformer, and a
checkpoint file's stored dict as it is on disk.

Fixtures live in conftest.py (``prepared_toy``, ``one_thread``, ...); these are plain functions, imported as
``from helpers import run_config, metric_records`` (pytest puts this directory on the import path).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from transformer_mt.config import Config, ModelConfig
from transformer_mt.data.bpe import EOS
from transformer_mt.model.transformer import Transformer
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


def tiny_transformer(embed_scale: float, eos_scale: float = 1.0) -> Transformer:
    """A 2+2-layer d_model-32 Transformer over 24 tokens with seed-0 weights, in eval mode, for the search tests.

    The embeddings (tied with the output layer) are scaled by ``embed_scale``: larger gives sharper distributions,
    so that beam hypotheses differ and end; smaller, flatter ones, so that samples vary. ``eos_scale`` scales the
    end-of-sentence row once more (below 1: hypotheses run longer before they end).
    """
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, d_ff=64, heads=4, encoder_layers=2, decoder_layers=2, dropout=0.0, max_positions=64)
    model = Transformer(cfg, vocab_size=24).eval()
    with torch.no_grad():
        model.embed.weight.mul_(embed_scale)
        model.embed.weight[EOS].mul_(eos_scale)
    return model


def load_state(path: str | Path) -> dict[str, Any]:
    """The dict a checkpoint file stores, read as torch reads it (safely), no entry checked: what tests inspect to
    see the format on disk, independent of `transformer_mt.checkpoint`'s reader."""
    return torch.load(path, map_location="cpu", weights_only=True)


def save_state(path: str | Path, state: dict[str, Any]) -> None:
    """Store ``state`` as a checkpoint file would, unchecked: how tests craft old, damaged or foreign checkpoints,
    which `transformer_mt.checkpoint.write_checkpoint` (a valid `Checkpoint` only) never writes."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
