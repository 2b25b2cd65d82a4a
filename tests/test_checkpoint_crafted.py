"""Crafted checkpoints whose entries look valid: every load (translate, average, resume) either works or is
the project's one-line user error naming the file and the entry, never another exception.

A real checkpoint of a tiny run has each top-level entry, and a few nested ones, changed in turn: removed,
of another type, out of range, of another shape.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import load_state, save_state

from transformer_mt.checkpoint import read_average, read_checkpoint
from transformer_mt.config import Config
from transformer_mt.decode.load import load_model
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


_WEIGHT_CHANGES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sparse": lambda t: t.to_sparse(),
    "sparse CSR": lambda t: t.to_sparse_csr(),
    "on the meta device": lambda t: torch.empty(t.shape, device="meta"),
    "of int32": lambda t: t.to(torch.int32),
    "of bool": lambda t: t > 0,
    "of complex": lambda t: t.to(torch.complex64),
    "quantized": lambda t: torch.quantize_per_tensor(t, 0.1, 0, torch.qint8),
}  # what passes a check of names and shapes: layout, device and dtype


def _weight(change: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], None]:
    return lambda s: s["model"].__setitem__(_first_weight(s), change(s["model"][_first_weight(s)]))


def _moment(change: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], None]:
    return lambda s: s["optimizer"]["state"][0].__setitem__("exp_avg", change(s["optimizer"]["state"][0]["exp_avg"]))


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
    **{f"a weight {name}": _weight(change) for name, change in _WEIGHT_CHANGES.items()},
    **{f"an Adam moment {name}": _moment(change) for name, change in _WEIGHT_CHANGES.items()},
    "epoch = 10**11": _set("epoch", 10**11),
    "update = 10**11": _set("update", 10**11),
    "best_valid_loss = nan": _set("best_valid_loss", math.nan),
    "best_valid_bleu = nan": _set("best_valid_bleu", math.nan),
    "optimizer betas of text": lambda s: s["optimizer"]["param_groups"][0].__setitem__("betas", "x"),
    "optimizer betas of one number": lambda s: s["optimizer"]["param_groups"][0].__setitem__("betas", (0.9,)),
    "optimizer beta of 2": lambda s: s["optimizer"]["param_groups"][0].__setitem__("betas", (0.9, 2.0)),
    "optimizer eps of NaN": lambda s: s["optimizer"]["param_groups"][0].__setitem__("eps", math.nan),
    "optimizer eps of 0": lambda s: s["optimizer"]["param_groups"][0].__setitem__("eps", 0.0),
    "optimizer weight_decay of -1": lambda s: s["optimizer"]["param_groups"][0].__setitem__("weight_decay", -1.0),
    "optimizer amsgrad of text": lambda s: s["optimizer"]["param_groups"][0].__setitem__("amsgrad", "x"),
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


@pytest.mark.parametrize("change", list(_WEIGHT_CHANGES))
def test_a_weight_of_another_layout_device_or_dtype_is_refused_naming_it(
    change: str, tiny_run: tuple[Config, Path], tmp_path: Path
) -> None:
    """Before, translate ended in load_state_dict's size mismatch and average in add(sparse, dense)."""
    path = _crafted(tiny_run[1], tmp_path, MUTATIONS[f"a weight {change}"])
    key = _first_weight(load_state(tiny_run[1]))
    fragment = {"sparse": "is a sparse_coo tensor, not a dense one", "sparse CSR": "is a sparse_csr tensor, not a "
                "dense one", "on the meta device": "is a tensor on the meta device, which holds no values",
                "of int32": "holds (torch.)?int32, (not|but) (torch.)?float32"}.get(change, "not real numbers")  # fmt: skip
    loads = [lambda p: read_average([tiny_run[1], p]), lambda p: load_model([p], "cpu")]
    for load in loads if change == "of int32" else [read_checkpoint, *loads]:  # an integer buffer is read, not used
        with pytest.raises(UserError, match=f"{path.name}: .*'{key}'.* {fragment}"):
            load(path)


@pytest.mark.parametrize(
    "mutation, fragment",
    [
        ("optimizer betas of text", "the 'optimizer' entry's betas of param group 0 is 'x', not 2 numbers"),
        ("optimizer eps of NaN", "eps of param group 0 is nan, not a number"),
        ("an Adam moment sparse", "'exp_avg' of parameter 0 is a sparse_coo tensor, not a dense one"),
        ("update = 10**11", "'update' entry is 100000000000, but its name says update 2"),
    ],
)
def test_resume_refuses_damaged_optimizer_settings_and_position(
    mutation: str, fragment: str, tiny_run: tuple[Config, Path], tmp_path: Path
) -> None:
    """Before, betas "x" failed at the first step (ValueError) and an update of 10**11 resumed there."""
    cfg, source = tiny_run
    run = tmp_path / "run"
    path = _crafted(source, run, MUTATIONS[mutation])
    train = dataclasses.replace(cfg.train, save_dir=str(run), max_updates=UPDATES + 1)
    with pytest.raises(UserError, match=f"{path.name}: .*{re.escape(fragment)}"):
        train_model(dataclasses.replace(cfg, train=train))


@pytest.mark.parametrize(
    "mutation, fragment",
    [
        ("epoch = 10**11", "'epoch' entry is 100000000000, more than a run reaches in its 2 updates (at most 33)"),
        ("best_valid_loss = nan", "'best_valid_loss' entry is nan, which no run records"),
    ],
)
def test_damaged_progress_is_refused_on_load(mutation: str, fragment: str, tiny_run: tuple[Config, Path], tmp_path):
    path = _crafted(tiny_run[1], tmp_path, MUTATIONS[mutation])
    with pytest.raises(UserError, match=f"{path.name}: the checkpoint's {re.escape(fragment)}"):
        read_checkpoint(path)


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
