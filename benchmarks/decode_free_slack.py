"""Peak resident size and CPU time of decoding against the freed memory a `Translator` keeps resident.

`transformer_mt.malloc.FreedMemory` gives the heap's free pages back after
a decoding step once more than its slack is free: a small slack keeps the
resident size near what is in use, at the price of refilling freed pages
the next step needs (page faults). This script translates the same lines
in one process with each slack in turn, for several rounds, and reports per
slack the median CPU time of the process and the median peak resident size
(``VmHWM``, reset before each run through ``/proc/self/clear_refs``; Linux
only). CPU time, not wall time: the machine may be shared.

    python benchmarks/decode_free_slack.py -c runs/multi30k/average.pt \\
        --text ../shared/data/multi30k/test.en --slack -1 0 32 64 128 256

A slack of -1 never trims within a batch (trims only between batches).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from transformer_mt.decode.translate import load_translator
from transformer_mt.malloc import FreedMemory, keep_freed_memory

SETTINGS = [
    "decode.quantize=int8",
    "decode.batch_tokens=4000",
    "decode.len_penalty_form=fairseq",
    "decode.stopping=k_finished",
    "decode.no_repeat_ngram=0",
]  # fmt: skip  translate_memory.py's settings


def peak_mib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) // 1024
    raise SystemExit("no VmHWM in /proc/self/status: Linux only")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--checkpoint", type=Path, required=True)
    parser.add_argument("--text", type=Path, required=True)
    parser.add_argument("--slack", type=int, nargs="+", default=[-1, 0, 64, 128], help="MiB; -1: never")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lines", type=int, default=1000)
    args = parser.parse_args()
    keep_freed_memory()  # as the tmt command does
    translator = load_translator([args.checkpoint], overrides=SETTINGS)
    translator.show_progress = False
    lines = args.text.read_text(encoding="utf-8").split("\n")[: args.lines]
    found: dict[int, list[tuple[float, int]]] = {slack: [] for slack in args.slack}
    reference = None
    for _ in range(args.rounds):
        for slack in args.slack:
            translator.freed = FreedMemory(slack << 20 if slack >= 0 else 1 << 60)
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
            start = time.process_time()
            outputs = translator.translate_lines(lines)
            found[slack].append((time.process_time() - start, peak_mib()))
            reference = reference or outputs
            if outputs != reference:
                raise SystemExit(f"slack {slack} changed a translation")
    print(f"{len(lines)} lines, medians of {args.rounds} rounds; every run translated alike")
    print("| slack MiB | CPU s | peak RSS MiB |\n| --- | --- | --- |")
    for slack, values in found.items():
        cpu = statistics.median(v[0] for v in values)
        peak = statistics.median(v[1] for v in values)
        print(f"| {'never' if slack < 0 else slack} | {cpu:.2f} | {peak:.0f} |")


if __name__ == "__main__":
    main()
