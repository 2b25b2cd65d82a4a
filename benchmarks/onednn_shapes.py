"""Resident memory of oneDNN's fp32 Linear over many row counts: as they come, or rounded by `padded_rows`.

oneDNN builds a kernel for each input shape it meets and keeps it; decoding
meets a new row count at nearly every batch and step. This multiplies
random row counts (1 to ``--max-rows``) through the four Linear shapes of a
d_model-256 model (256x256, 256x1024, 1024x256 and the 8000-word output
projection), each variant in a process of its own, and prints the resident
size every ``--every`` row counts.

    python benchmarks/onednn_shapes.py
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = [(256, 256), (256, 1024), (1024, 256), (256, 8000)]


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def run(rounded: bool, counts: int, max_rows: int, every: int) -> None:
    from transformer_mt.model.onednn import padded_rows

    torch.manual_seed(0)
    layers = [(torch.randn(d_out, d_in), torch.randn(d_out)) for d_in, d_out in SHAPES]
    rng = random.Random(0)
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(1, counts + 1):
            rows = rng.randint(1, max_rows)
            padded = padded_rows(rows) if rounded else rows
            for weight, bias in layers:
                x = F.pad(torch.randn(rows, weight.shape[1]), (0, 0, 0, padded - rows))
                torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
            if i % every == 0:
                name = "rounded" if rounded else "as they come"
                print(f"{name:>13} {i:>6} {resident_mib():>8.0f} {time.perf_counter() - start:>8.1f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", type=int, default=1200, help="row counts to multiply")
    parser.add_argument("--max-rows", type=int, default=2000)
    parser.add_argument("--every", type=int, default=300)
    parser.add_argument("--variant", choices=["rounded", "raw"], help=argparse.SUPPRESS)  # one child process
    args = parser.parse_args()
    if args.variant:
        torch.set_num_threads(2)
        run(args.variant == "rounded", args.counts, args.max_rows, args.every)
        return
    print(f"{'row counts':>13} {'seen':>6} {'RSS MiB':>8} {'s':>8}")
    for variant in ("raw", "rounded"):
        cmd = [sys.executable, __file__, "--variant", variant, "--counts", str(args.counts),
               "--max-rows", str(args.max_rows), "--every", str(args.every)]  # fmt: skip
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
