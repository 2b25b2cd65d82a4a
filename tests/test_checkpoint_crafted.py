"""Crafted checkpoints whose entries look valid: every load (translate, average, resume) either works or is
the project's one-line user error naming the file and the entry, never another exception.

A real checkpoint of a tiny run has each top-level entry, and a few nested ones, changed in turn: removed,
of another type, out of range, of another shape.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import load_state, save_state

from transformer_mt.checkpoint import read_average, read_checkpoint
from transformer_mt.config import Config
from transformer_mt.decode.translate import Translator
from transformer_mt.errors import UserError
from transformer_mt.run_names import checkpoint_name
from transformer_mt.train.trainer import train_model

pytestmark = pytest.mark.usefixtures("one_thread")

UPDATES = 2


@pytest.fixture(scope="module")
def tiny_run(prepared_toy: Config, tmp_path_factory: pytest.TempPathFactory) -> tuple[Config, Path]:
    """A run of 2 updates: its config and its one checkpoint, which holds every entry a training run writes."""
    run = tmp_path_factory.mktemp("crafted") / "run"
    train = dataclasses.replace(
        prepared_toy.train, save_dir=str(run), max_updates=UPDATES, save_every_updates=UPDATES, validate_every=1,
        num_threads=1,
    )  # fmt: skip
    cfg = dataclasses.replace(prepared_toy, train=train)
    train_model(cfg)
    return cfg, run / checkpoint_name(UPDATES)


def _weights(state: dict) -> dict:
    return state["model"]


def _first_weight(state: dict) -> str:
    return next(k for k, v in state["model"].items() if v.dim() == 2)


def _set(key: str, value: object) -> Callable[[dict], None]:
    return lambda s: s.__setitem__(key, value)


def _del(key: str) -> Callable[[dict], None]:
    return lambda s: s.pop(key, None)


_VALUES = {"none": None, "text": "x", "minus": -5, "huge": 10**18, "nan": math.nan, "list": [1], "dict": {}}
_TOP = [
    "model", "config", "spm_model", "update", "epoch", "batch_in_epoch", "best_valid_loss", "valid_loss",
    "valid_update", "minutes", "valid_history", "valid_bleu", "best_valid_bleu", "stale_validations", "optimizer",
    "scaler", "rng", "batching",
]  # fmt: skip

MUTATIONS: dict[str, Callable[[dict], None]] = {
    **{f"{key} removed": _del(key) for key in _TOP},
    **{f"{key} = {name}": _set(key, value) for key in _TOP for name, value in _VALUES.items()},
    "update = -7": _set("update", -7),
    "batch_in_epoch = 10**9": _set("batch_in_epoch", 10**9),
    "batch_in_epoch = -3": _set("batch_in_epoch", -3),
    "minutes = inf": _set("minutes", math.inf),
    "a weight of another shape": lambda s: s["model"].__setitem__(_first_weight(s), torch.zeros(3, 5)),
    "a weight missing": lambda s: s["model"].pop(_first_weight(s)),
    "an extra weight": lambda s: s["model"].__setitem__("extra.weight", torch.zeros(2)),
    "integer weights": lambda s: s.__setitem__("model", {k: v.to(torch.int64) for k, v in s["model"].items()}),
    "a weight of NaN": lambda s: s["model"][_first_weight(s)].fill_(math.nan),
    "spm_model garbage": _set("spm_model", torch.tensor(list(b"not a model"), dtype=torch.uint8)),
    "spm_model empty": _set("spm_model", torch.zeros(0, dtype=torch.uint8)),
    "config of another model": lambda s: s["config"]["model"].__setitem__("d_model", 64),
    "config with a bad value": lambda s: s["config"]["model"].__setitem__("heads", 0),
    "optimizer state of text": lambda s: s["optimizer"].__setitem__("state", {0: "x"}),
    "optimizer state of another shape": lambda s: s["optimizer"]["state"][0].__setitem__("exp_avg", torch.zeros(1)),
    "optimizer without param groups": lambda s: s["optimizer"].__setitem__("param_groups", []),
    "optimizer param group of text": lambda s: s["optimizer"].__setitem__("param_groups", ["x"]),
    "optimizer lr of text": lambda s: s["optimizer"]["param_groups"][0].__setitem__("lr", "x"),
    "rng torch_cpu of text": lambda s: s["rng"].__setitem__("torch_cpu", ["x"]),
    "rng torch_cpu empty": lambda s: s["rng"].__setitem__("torch_cpu", []),
    "rng torch_cpu of another length": lambda s: s["rng"].__setitem__("torch_cpu", [torch.zeros(3, dtype=torch.uint8)]),
    "rng world_size -1": lambda s: s["rng"].__setitem__("world_size", -1),
    "rng without python": lambda s: s["rng"].pop("python", None),
    "rng numpy of text": lambda s: s["rng"].__setitem__("numpy", "x"),
    "batching without seed": lambda s: s["batching"].pop("seed"),
    "batching batches of text": lambda s: s["batching"].__setitem__("batches", "x"),
    "scaler of text": lambda s: s.__setitem__("scaler", {"scale": "x"}),
}


def _crafted(source: Path, directory: Path, mutate: Callable[[dict], None]) -> Path:
    state = load_state(source)
    mutate(state)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / checkpoint_name(UPDATES)
    save_state(path, state)
    return path


def _works_or_user_error(load: Callable[[], object]) -> None:
    try:
        load()
    except UserError as err:
        assert "\n" not in str(err) and len(str(err)) < 600, str(err)


@pytest.mark.parametrize("mutation", list(MUTATIONS))
@pytest.mark.slow
def test_translate_and_average_load_or_refuse(mutation: str, tiny_run: tuple[Config, Path], tmp_path: Path) -> None:
    path = _crafted(tiny_run[1], tmp_path, MUTATIONS[mutation])
    _works_or_user_error(lambda: read_checkpoint(path))
    _works_or_user_error(lambda: Translator.from_checkpoints([path], "cpu").translate_lines(["a b c"]))
    _works_or_user_error(lambda: read_average([path, tiny_run[1]]))
    _works_or_user_error(lambda: read_average([tiny_run[1], path]))


def test_resume_refuses_a_position_past_the_epoch(tiny_run: tuple[Config, Path], tmp_path: Path) -> None:
    cfg, source = tiny_run
    run = tmp_path / "run"
    _crafted(source, run, MUTATIONS["batch_in_epoch = 10**9"])
    train = dataclasses.replace(cfg.train, save_dir=str(run), max_updates=UPDATES + 1)
    with pytest.raises(UserError, match=r"'batch_in_epoch' entry is 1000000000, past the \d+ batches of epoch 1"):
        train_model(dataclasses.replace(cfg, train=train))


@pytest.mark.parametrize("mutation", list(MUTATIONS))
@pytest.mark.slow
def test_resume_loads_or_refuses(mutation: str, tiny_run: tuple[Config, Path], tmp_path: Path) -> None:
    cfg, source = tiny_run
    run = tmp_path / "run"
    _crafted(source, run, MUTATIONS[mutation])
    train = dataclasses.replace(cfg.train, save_dir=str(run), max_updates=UPDATES + 1)
    _works_or_user_error(lambda: train_model(dataclasses.replace(cfg, train=train)))


@pytest.mark.parametrize(
    "mutation, fragment",
    [
        ("update = -7", "'update' entry is -7, outside 0..1000000000000"),
        ("minutes = nan", "'minutes' entry is nan"),
        ("a weight of another shape", "the 'model' entry does not fit the model its config describes"),
        ("spm_model garbage", "the 'spm_model' entry is not a sentencepiece model"),
    ],
)
@pytest.mark.slow
def test_tmt_translate_names_the_file_and_the_entry(
    mutation: str, fragment: str, tiny_run: tuple[Config, Path], tmp_path: Path
) -> None:
    from helpers import assert_user_error, tmt

    path = _crafted(tiny_run[1], tmp_path / "crafted", MUTATIONS[mutation])
    source, out = tmp_path / "in.en", tmp_path / "out.de"
    source.write_text("a b c\n")
    assert_user_error(tmt("translate", "-c", str(path), "-i", str(source), "-o", str(out)), str(path), fragment)
    assert not out.exists()
