"""Benchmark `tmt prepare`: encoding speed and peak memory of the whole process tree.

Generates a toy corpus of N pairs (`tmt synth`'s grammar), runs `tmt prepare`
on it in a subprocess and prints one markdown table row. The BPE sample is
capped (``--sample``, default 200k sentences) so that memory should be flat
in N: run it at 100k and 1M pairs and compare the peak RSS column.

    python benchmarks/prepare.py --pairs 1000000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from transformer_mt.data.synthetic import write_corpus

PAGE = os.sysconf("SC_PAGE_SIZE")


def tree_rss(root: int) -> int:
    """Resident bytes of ``root`` and all its descendants (Linux /proc)."""
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            statm = Path(f"/proc/{entry}/statm").read_text().split()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        parents[int(entry)] = int(fields[1])
        rss[int(entry)] = int(statm[1]) * PAGE
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += rss.get(pid, 0)
        stack.extend(child for child, parent in parents.items() if parent == pid)
    return total


def run_prepare(config: Path) -> tuple[float, int]:
    """Run `tmt prepare` and return (wall seconds, peak summed RSS in bytes, sampled every 50 ms)."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "transformer_mt", "prepare", str(config)], stderr=subprocess.PIPE)
    peak = [0]

    def watch() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_rss(proc.pid))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    _, err = proc.communicate()
    watcher.join()
    if proc.returncode:
        sys.exit(f"tmt prepare failed:\n{err.decode()[-3000:]}")
    return time.perf_counter() - start, peak[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=1_000_000, help="training sentence pairs")
    parser.add_argument(
        "--vocab", type=int, default=1000, help="bpe.vocab_size (the toy grammar has under 1800 pieces)"
    )
    parser.add_argument("--sample", type=int, default=200_000, help="bpe.sample_sentences")
    parser.add_argument("--workers", type=int, default=0, help="data.workers (0: one per core)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep files here (default: a temp dir)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        root = args.workdir or Path(tmp)
        t0 = time.perf_counter()
        write_corpus(root / "corpus", args.pairs, 1000, 1000, seed=1)
        synth_s = time.perf_counter() - t0
        config = root / "bench.yaml"
        config.write_text(
            f"data: {{train: {root}/corpus/train, valid: {root}/corpus/valid, test: {root}/corpus/test, "
            f"dir: {root}/prepared, workers: {args.workers}, max_len: 250}}\n"
            f"bpe: {{vocab_size: {args.vocab}, sample_sentences: {args.sample}}}\n",
            encoding="utf-8",
        )
        wall, peak = run_prepare(config)
        main_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # largest single child
        manifest = json.loads((root / "prepared" / "manifest.json").read_text())
    sec = manifest["seconds"]
    sentences = sum(2 * s["sentences"] for s in manifest["splits"].values())
    print(f"(corpus generated in {synth_s:.0f} s)", file=sys.stderr)
    print(
        "| pairs | vocab | BPE sample | workers | clean s | BPE s | encode s | encode sent/s | total s "
        "| peak RSS tree | peak RSS one process |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(
        f"| {args.pairs:,} | {manifest['vocab_size']} | {args.sample:,} | {manifest['workers']} | {sec['clean']:.1f} "
        f"| {sec['bpe']:.1f} | {sec['encode']:.1f} | {sentences / sec['encode']:,.0f} | {wall:.1f} "
        f"| {peak / 2**20:,.0f} MiB | {main_rss / 2**20:,.0f} MiB |"
    )


if __name__ == "__main__":
    main()
