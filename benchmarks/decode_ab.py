"""Decoding before and after a change: this tree against another checkout, every search mode, outputs compared.

Each run is a fresh process that imports tmt from one tree (``PYTHONPATH``),
loads ``--checkpoint``, translates ``--text`` in one mode and prints its
seconds (translation only, the model loaded) and a hash of its output. The
trees take turns, mode by mode, ``--rounds`` times, so a machine busy with
other work slows both alike; reported: each mode's median seconds per tree,
the ratio, and whether the two trees wrote the same bytes (they must, for a
refactoring).

Modes: ``beam`` (the checkpoint's settings, fp32), ``int8``, ``sample``
(``topk:10``, 2 samples a line), ``constraints`` (each line's first word of
four letters or more as its constraint), ``nbest`` (beam 4, 4 best).

    python benchmarks/decode_ab.py --before ../before --checkpoint runs/m30k/average.pt \\
        --text ../shared/data/multi30k/test.en --lines 200 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODES = {
    "beam": [],
    "int8": ["decode.quantize=int8"],
    "sample": ["decode.sampling=topk:10", "decode.beam_size=1", "decode.nbest=2"],
    "constraints": [],
    "nbest": ["decode.nbest=4"],
}

RUN = r"""
import hashlib, sys, time, torch
from transformer_mt.decode.translate import Translator
torch.set_num_threads(int(sys.argv[5]))
mode, lines = sys.argv[2], open(sys.argv[3], encoding="utf-8").read().splitlines()[: int(sys.argv[4])]
t = Translator.from_checkpoints([sys.argv[1]], device="cpu", overrides=sys.argv[6:])
t.show_progress = False
if mode == "constraints":
    first = [next((w for w in line.split() if len(w) >= 4 and w.isalpha()), "") for line in lines]
    lines = [f"{line}\t{w}" if w else line for line, w in zip(lines, first)]
start = time.perf_counter()
if mode == "constraints":
    out = t.translate_constrained(lines, 1)
else:
    out = t.translate_lines_nbest(lines)
seconds = time.perf_counter() - start
text = "\n".join(f"{h.text}\t{h.score!r}" for hyps in out for h in hyps)
print(seconds, hashlib.sha256(text.encode()).hexdigest()[:16])
"""


def run(tree: Path, args: argparse.Namespace, mode: str) -> tuple[float, str]:
    """One timed translation in a fresh process importing tmt from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, "-c", RUN, str(args.checkpoint), mode, str(args.text), str(args.lines), str(args.threads)]
    done = subprocess.run([*cmd, *MODES[mode]], env=env, capture_output=True, text=True, cwd=tree)
    if done.returncode != 0:
        sys.exit(f"{tree} {mode}: {done.stderr.strip().splitlines()[-1]}")
    seconds, digest = done.stdout.split()
    return float(seconds), digest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="the other checkout (its repository root)")
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--text", type=Path, required=True, help="source lines, one per line")
    parser.add_argument("--lines", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": ROOT}
    print(f"{args.lines} lines of {args.text}, {args.threads} thread(s), {args.rounds} rounds, median seconds")
    print(f"{'mode':<12} {'before':>8} {'after':>8} {'after/before':>13}  same output")
    for mode in args.modes:
        times: dict[str, list[float]] = {name: [] for name in trees}
        digests: dict[str, set[str]] = {name: set() for name in trees}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                seconds, digest = run(tree, args, mode)
                times[name].append(seconds)
                digests[name].add(digest)
        before, after = statistics.median(times["before"]), statistics.median(times["after"])
        same = digests["before"] == digests["after"] and len(digests["after"]) == 1
        print(f"{mode:<12} {before:8.2f} {after:8.2f} {after / before:13.3f}  {'yes' if same else 'NO'}", flush=True)


if __name__ == "__main__":
    main()
