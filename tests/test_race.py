"""benchmarks/multi30k_race.py: its arguments (several seeds, an update budget, resuming) and the table over the seeds."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "multi30k_race.py"
_spec = importlib.util.spec_from_file_location("multi30k_race", _PATH)
race = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(race)


def test_seed_and_seeds_and_the_budgets():
    args = race.parse_args([])
    assert (args.seeds, args.minutes, args.updates) == ([1], 20.0, 0)
    assert race.run_dir(args, 1) == Path("runs/race_tmt_20min_s1")  # the name races always had
    args = race.parse_args(["--seed", "3", "--run-dir", "runs/mine"])
    assert args.seeds == [3] and race.run_dir(args, 3) == Path("runs/mine")
    args = race.parse_args(["--updates", "800", "--seeds", "1", "2", "--run-dir", "runs/sr"])
    assert (args.seeds, args.minutes, args.updates) == ([1, 2], 0.0, 800)  # no time limit
    assert [race.run_dir(args, s) for s in args.seeds] == [Path("runs/sr_s1"), Path("runs/sr_s2")]
    args = race.parse_args(["--updates", "800", "--minutes", "30", "--seeds", "1", "2"])
    assert race.run_dir(args, 2) == Path("runs/race_tmt_800u_30min_s2")
    args = race.parse_args(["--recipe", "hour"])
    assert (args.minutes, race.run_dir(args, 1)) == (60.0, Path("runs/race_hour_60min_s1"))  # the config's own hour
    assert race.parse_args(["--recipe", "fairseq"]).minutes == 20.0


def _summary(seed: int, updates: int, valid: tuple[float, float], test: tuple[float, float]) -> dict:
    def scores(v: float, t: float) -> dict:
        return {"valid": v, "valid_ratio": 1.0, "test": t, "test_ratio": 1.0}

    return {
        "seed": seed,
        "updates": updates,
        "scores": {
            f"update {updates} (last)": scores(valid[0], test[0]),
            "average of the last 5 (760, 770, 780, 790, 800)": scores(valid[1], test[1]),
        },
    }


def test_the_seeds_table_has_a_row_per_seed_and_their_mean():
    table = race.seeds_table(
        [_summary(1, 800, (30.0, 31.0), (32.0, 33.0)), _summary(2, 800, (29.0, 30.0), (31.0, 31.5))], ["valid", "test"]
    )
    assert table.splitlines() == [
        "| seed | updates | valid last | valid average | test last | test average |",
        "| --- | --- | --- | --- | --- | --- |",
        "| 1 | 800 | 30.0 | 31.0 | 32.0 | 33.0 |",
        "| 2 | 800 | 29.0 | 30.0 | 31.0 | 31.5 |",
        "| mean of 2 | | **29.50** | **30.50** | **31.50** | **32.25** |",
    ]


def test_a_run_directory_with_checkpoints_is_refused_unless_resumed(tmp_path, monkeypatch):
    run = tmp_path / "race"
    run.mkdir()
    (run / "checkpoint_u0000100.pt").write_bytes(b"")
    args = race.parse_args(["--updates", "800", "--run-dir", str(run)])
    with pytest.raises(SystemExit, match="already holds checkpoints.*--resume"):
        race.race(args, 1)

    calls = []

    class Trained(Exception):
        pass

    def tmt(*argv: str) -> None:  # the subprocess boundary: record the commands, stop after `tmt train`
        calls.append(argv)
        if argv[0] == "train":
            raise Trained

    monkeypatch.setattr(race, "tmt", tmt)
    with pytest.raises(Trained):
        race.race(race.parse_args(["--updates", "800", "--run-dir", str(run), "--resume"]), 1)
    assert [c[0] for c in calls] == ["prepare", "train"]
    assert f"train.save_dir={run}" in calls[1]  # the same directory: `tmt train` resumes from its newest checkpoint


def test_trainer_minutes_run_on_across_a_resume():
    first = [{"kind": "start", "update": 0}, {"kind": "train", "update": 20, "minutes": 0.4}]
    resumed = [{"kind": "start", "update": 4543}, {"kind": "valid", "update": 5000, "minutes": 98.25}]
    metrics = [*first, {"kind": "train", "update": 4540, "minutes": 89.9}, *resumed]
    metrics.append({"kind": "end", "update": 5600, "minutes": 106.123})
    assert race.trainer_minutes(metrics) == 106.12  # the whole run, not the resumed part only
    assert race.trainer_minutes([{"kind": "start", "update": 0}]) is None
