"""The Multi30k race: BLEU after a fixed budget of CPU wall-clock time, beside fairseq's figures.

Runs the real pipeline as a user would: `tmt prepare` and `tmt train` for
``--minutes`` of wall clock, then averages the last checkpoints, translates
(beam 4) and scores sacreBLEU (13a, cased) against the raw references of
test2016 and of the validation split (select recipes on the validation
scores; test2016 is the figure fairseq published).

Three recipes:

- ``--recipe fairseq`` replays fairseq 0.12.2's exact recipe
  (configs/multi30k_fairseq.yaml). Its schedule does not depend on the budget,
  so one 20-minute run also gives the checkpoints at 200, 400 and 600 updates
  and at 5, 10 and 15 minutes, each compared with fairseq's figure.
- ``--recipe tmt`` trains tmt's own configs/multi30k.yaml, whose schedule and
  averaging snapshots fit the budget: every budget is its own run.
- ``--recipe hour`` trains configs/multi30k_hour.yaml, the recipe for 60
  minutes (a smaller model with more dropout), the same way.

Without ``--minutes`` or ``--updates`` the budget is the recipe's own
``train.max_minutes`` (20 minutes; an hour for ``hour``).

    python benchmarks/multi30k_race.py --recipe fairseq --minutes 20
    python benchmarks/multi30k_race.py --recipe tmt --minutes 10 --seed 2
    python benchmarks/multi30k_race.py --recipe hour --updates 5600 --seeds 1 2
    python benchmarks/multi30k_race.py --recipe tmt --updates 800 --seeds 1 2 --set bpe.sampling_alpha=0.1

``--seeds 1 2 ...`` runs one race per seed and ends with a table of each
seed's valid and test sacreBLEU (last checkpoint and average) and their
mean: how to tune a recipe on one's own small corpus, selecting on valid.
``--updates N`` bounds training by updates instead of the clock (no time
limit unless ``--minutes`` is given too): on a shared machine a race against
the clock is unfair to whichever run had the busier minutes.

A race cut short (a reboot, Ctrl-C) goes on from its newest checkpoint with
the same command and ``--resume``: training resumes bit-exactly, so the
scores are those of an uninterrupted run; ``trained_minutes`` in race.json
(this script's clock around ``tmt train``, prepare included) then counts the
resumed part only (``resumed`` says so), while ``trainer_minutes`` (the
trainer's own clock in metrics.jsonl) counts the whole run.

Run it from the repository root (the configs' data paths are relative to it)
on an otherwise idle machine: the figure is a race against the clock.
Results go to RUN_DIR/race.json and markdown tables on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from transformer_mt.checkpoint import read_checkpoint
from transformer_mt.config import load_config
from transformer_mt.evaluate import evaluate_checkpoint
from transformer_mt.train.average import average_checkpoints, last_checkpoints
from transformer_mt.train.run_checkpoints import checkpoint_update, list_checkpoints

REPO = Path(__file__).resolve().parents[1]
RECIPES = {
    "tmt": "configs/multi30k.yaml",
    "hour": "configs/multi30k_hour.yaml",
    "fairseq": "configs/multi30k_fairseq.yaml",
}
DATA = "../shared/data/multi30k"
# fairseq 0.12.2, its recipe on this 2-core machine: test2016 sacreBLEU by update, by minute, and averaged.
FAIRSEQ_BY_UPDATE = {200: 10.9, 400: 23.9, 600: 29.1, 783: 29.9}
FAIRSEQ_BY_MINUTE = {5: 10.9, 10: 23.9, 15: 29.1, 20: 29.9}
FAIRSEQ_AVERAGE_20_MIN = 30.5


def tmt(*args: str) -> None:
    """Run one `tmt` command as a user would; stop the race if it fails."""
    subprocess.run([sys.executable, "-m", "transformer_mt", *args], check=True)


def sample_load(samples: list[float], stop: threading.Event) -> None:
    """The machine's 1-minute load average every 30 s: about 2 while the race alone keeps 2 cores busy, more when
    other work shares them (the race is against the clock, so its figures only hold for an idle machine)."""
    while not stop.wait(30.0):
        samples.append(os.getloadavg()[0])


def score(checkpoint: Path, out: Path, splits: list[str]) -> dict[str, float]:
    """sacreBLEU of ``checkpoint`` on each split, with the checkpoint's own decoding settings."""
    result = {}
    for split in splits:
        scores = evaluate_checkpoint(
            [checkpoint], src=f"{DATA}/{split}.en", ref=f"{DATA}/{split}.de", output=out / f"eval_{split}"
        )
        sacre = scores["sacrebleu"]
        result[split] = round(sacre["score"], 2)
        result[f"{split}_ratio"] = round(sacre["hyp_len"] / max(sacre["ref_len"], 1), 3)
    return result


def checkpoints_to_score(run: Path, recipe: str, minutes: float) -> dict[str, tuple[Path, float | None]]:
    """Row name -> (checkpoint, fairseq's figure for the same point): the last checkpoint, plus (for the fixed
    fairseq schedule) those at fairseq's update counts and at its minute marks."""
    ckpts = {checkpoint_update(p): p for p in list_checkpoints(run)}
    last = max(ckpts)
    chosen = {f"update {last} (last)": (ckpts[last], FAIRSEQ_BY_MINUTE.get(round(minutes)))}
    if recipe != "fairseq":
        return chosen
    for update, figure in FAIRSEQ_BY_UPDATE.items():
        if update in ckpts and update != last:
            chosen[f"update {update}"] = (ckpts[update], figure)
    by_minutes = {u: read_checkpoint(p).progress.minutes for u, p in ckpts.items()}
    for mark, figure in FAIRSEQ_BY_MINUTE.items():
        before = [u for u, m in by_minutes.items() if m <= mark]
        if mark < minutes and before:
            chosen[f"{mark} min (update {max(before)})"] = (ckpts[max(before)], figure)
    return chosen


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="tmt")
    parser.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="training wall-clock budget (default: the recipe's train.max_minutes; none with --updates)",
    )
    parser.add_argument(
        "--updates", type=int, default=0, help="train this many updates, with no time limit unless --minutes is given"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="several seeds, one run each (not --seed)")
    parser.add_argument(
        "--run-dir",
        default=None,
        help="a fresh directory per race (default runs/race_RECIPE_BUDGET_sSEED); with several seeds, DIR_sSEED each",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="go on with a race whose run directory holds checkpoints (one cut short), from the newest of them",
    )
    parser.add_argument("--set", action="append", default=[], dest="overrides", help="extra config overrides")
    parser.add_argument("--splits", nargs="+", default=["valid", "test"], help="Multi30k splits to score")
    args = parser.parse_args(argv)
    if args.minutes is None:
        args.minutes = 0.0 if args.updates else load_config(REPO / RECIPES[args.recipe]).train.max_minutes
    args.seeds = args.seeds or [args.seed]
    return args


def budget_name(args: argparse.Namespace) -> str:
    """``20min``, ``800u`` or ``800u_20min``: the budget as run directories name it."""
    parts = ([f"{args.updates}u"] if args.updates else []) + ([f"{args.minutes:g}min"] if args.minutes else [])
    return "_".join(parts)


def run_dir(args: argparse.Namespace, seed: int) -> Path:
    if args.run_dir is None:
        return Path(f"runs/race_{args.recipe}_{budget_name(args)}_s{seed}")
    return Path(args.run_dir if len(args.seeds) == 1 else f"{args.run_dir}_s{seed}")


def race(args: argparse.Namespace, seed: int) -> dict:
    """One race: prepare, train, score the last checkpoint and the average; prints its table, returns race.json."""
    config = RECIPES[args.recipe]
    run = run_dir(args, seed)
    resumed = run.exists() and any(run.glob("checkpoint_*.pt"))
    if resumed and not args.resume:
        sys.exit(
            f"{run} already holds checkpoints: a race starts from scratch; pass another --run-dir, "
            "or --resume (with the same options) to go on with that race from its newest checkpoint"
        )
    budget = [f"train.max_minutes={args.minutes}"] + ([f"train.max_updates={args.updates}"] if args.updates else [])
    sets = [f"train.save_dir={run}", *budget, f"train.seed={seed}", *args.overrides]
    set_args = [a for s in sets for a in ("--set", s)]
    cfg = load_config(config, sets)

    tmt("prepare", config, *set_args)
    start, load, stop = time.monotonic(), [], threading.Event()
    sampler = threading.Thread(target=sample_load, args=(load, stop), daemon=True)
    sampler.start()
    tmt("train", config, *set_args)
    stop.set()
    train_minutes = (time.monotonic() - start) / 60

    rows: dict[str, dict[str, float]] = {}
    peer: dict[str, float | None] = {}
    for name, (path, figure) in checkpoints_to_score(run, args.recipe, args.minutes).items():
        rows[name], peer[name] = score(path, run / f"eval_u{checkpoint_update(path)}", args.splits), figure
    k = cfg.train.average_last
    averaged = last_checkpoints(run, k)
    average_checkpoints(averaged, run / "average.pt")
    names = ", ".join(str(checkpoint_update(p)) for p in averaged)
    name = f"average of the last {len(averaged)} ({names})"
    rows[name] = score(run / "average.pt", run / "eval_average", args.splits)
    peer[name] = FAIRSEQ_AVERAGE_20_MIN if round(args.minutes) == 20 else None

    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_lines = [m for m in metrics if m["kind"] == "train"]
    updates = max(m["update"] for m in metrics)
    tok_s = sum(m["tgt_tokens_per_s"] for m in train_lines) / max(len(train_lines), 1)
    summary = {
        "recipe": args.recipe, "config": config, "overrides": args.overrides, "seed": seed,
        "minutes": args.minutes, "max_updates": args.updates, "trained_minutes": round(train_minutes, 2),
        "resumed": resumed, "trainer_minutes": trainer_minutes(metrics),
        "updates": updates, "tgt_tokens_per_s": round(tok_s), "load_average": round(sum(load) / max(len(load), 1), 2),
        "scores": rows,
    }  # fmt: skip
    (run / "race.json").write_text(json.dumps(summary, indent=2) + "\n")

    print(
        f"{args.recipe} recipe, seed {seed}, {budget_name(args)}: {updates} updates, {tok_s:,.0f} tgt tok/s, "
        f"load average {summary['load_average']} while training"
    )
    print("| checkpoint | " + " | ".join(f"{s} sacreBLEU (ratio)" for s in args.splits) + " | fairseq test2016 |")
    print("| --- | " + " | ".join("---" for _ in args.splits) + " | --- |")
    for name, scores in rows.items():
        cells = " | ".join(f"{scores[s]:.1f} ({scores[s + '_ratio']:.2f})" for s in args.splits)
        print(f"| {name} | {cells} | {'' if peer[name] is None else peer[name]} |")
    return summary


def trainer_minutes(metrics: list[dict]) -> float | None:
    """The trainer's wall-clock minutes (metrics.jsonl): training only, a resumed run's earlier parts included."""
    return max((round(m["minutes"], 2) for m in metrics if "minutes" in m), default=None)


def seeds_table(summaries: list[dict], splits: list[str]) -> str:
    """Markdown: per seed, its updates and each split's sacreBLEU of the last checkpoint and of the average, then
    the mean over the seeds (select on valid; test is for the record)."""

    def last_and_average(summary: dict) -> tuple[dict, dict]:
        names = list(summary["scores"])
        average = next(n for n in names if n.startswith("average"))
        last = next(n for n in names if n.endswith("(last)"))
        return summary["scores"][last], summary["scores"][average]

    header = ["seed", "updates"] + [f"{s} {kind}" for s in splits for kind in ("last", "average")]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    columns: list[list[float]] = [[] for _ in range(2 * len(splits))]
    for summary in summaries:
        last, average = last_and_average(summary)
        values = [scores[s] for s in splits for scores in (last, average)]
        for column, value in zip(columns, values, strict=True):
            column.append(value)
        lines.append(f"| {summary['seed']} | {summary['updates']} | " + " | ".join(f"{v:.1f}" for v in values) + " |")
    means = [sum(c) / len(c) for c in columns]
    lines.append(f"| mean of {len(summaries)} | | " + " | ".join(f"**{m:.2f}**" for m in means) + " |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    summaries = [race(args, seed) for seed in args.seeds]
    print(f"\n{args.recipe} recipe, {budget_name(args)}, sacreBLEU per seed (select on valid):")
    print(seeds_table(summaries, args.splits))


if __name__ == "__main__":
    main()
