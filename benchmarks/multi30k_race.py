"""The Multi30k race: test2016 BLEU after a fixed budget of CPU wall-clock time.

Runs the real pipeline through the `tmt` commands on configs/multi30k.yaml:
prepare -> train for ``--minutes`` -> average the last 5 checkpoints -> beam 4 ->
sacreBLEU (13a, cased) against the raw references, and prints one markdown row
beside the peer's figure for the same budget. Peer (fairseq 0.12.2, same recipe,
same 2-core machine): test2016 sacreBLEU 10.9 after 5 minutes, 23.9 after 10,
29.1 after 15, 30.5 after 20 (29.9 from the last checkpoint alone).

    python benchmarks/multi30k_race.py --minutes 20

Run it from the repository root (the config's data paths are relative to it)
on an otherwise idle machine: the figure is a race against the clock.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

FAIRSEQ_BLEU = {5: 10.9, 10: 23.9, 15: 29.1, 20: 30.5}


def tmt(*args: str) -> None:
    """Run one `tmt` command as a user would; stop the race if it fails."""
    subprocess.run([sys.executable, "-m", "transformer_mt", *args], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=20.0, help="training wall-clock budget")
    parser.add_argument("--config", default="configs/multi30k.yaml")
    parser.add_argument("--run-dir", default="runs/multi30k_race", help="a fresh directory per race")
    parser.add_argument("--set", action="append", default=[], dest="overrides", help="extra config overrides")
    args = parser.parse_args()

    run = Path(args.run_dir)
    if run.exists() and any(run.glob("checkpoint_*.pt")):
        sys.exit(f"{run} already holds checkpoints: a race starts from scratch; pass another --run-dir")
    sets = [f"train.save_dir={run}", f"train.max_minutes={args.minutes}", *args.overrides]
    set_args = [a for s in sets for a in ("--set", s)]

    tmt("prepare", args.config, *set_args)
    start = time.monotonic()
    tmt("train", args.config, *set_args)
    train_minutes = (time.monotonic() - start) / 60
    tmt("average", str(run), "--last", "5", "-o", str(run / "average.pt"))
    data = "../shared/data/multi30k/test"
    tmt(
        "evaluate", "-c", str(run / "average.pt"), "--src", f"{data}.en", "--ref", f"{data}.de", "-o", str(run / "eval")
    )

    scores = json.loads((run / "eval" / "scores.json").read_text())
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_lines = [m for m in metrics if m["kind"] == "train"]
    updates = max(m["update"] for m in metrics)
    tok_s = sum(m["tgt_tokens_per_s"] for m in train_lines) / max(len(train_lines), 1)
    peer = FAIRSEQ_BLEU.get(round(args.minutes), float("nan"))
    print("| budget | updates | tgt tok/s | tmt test2016 sacreBLEU | fairseq (same budget) |")
    print("| --- | --- | --- | --- | --- |")
    print(
        f"| {args.minutes:g} min (trained {train_minutes:.1f}) | {updates} | {tok_s:,.0f} "
        f"| {scores['sacrebleu']['score']:.1f} | {peer} |"
    )


if __name__ == "__main__":
    main()
