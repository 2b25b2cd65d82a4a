"""Peak resident memory of `tmt translate -i FILE -o OUT` on a short and a very long input: bounded by the window?

`tmt translate` reads a file in windows of --window-lines lines, translates
and writes each before reading the next, so its memory should not grow with
the input. Here a fresh process translates the first N lines of a file made
of Multi30k training lines repeated, for a small and a large N, and the
kernel's peak resident size (``ru_maxrss`` of the waited-for child,
`os.wait4`) of the two runs is compared: the goal is a large-run peak within
1.2x of the small-run one.

The model is tiny and untrained (d_model 32, 1+1 layers, a BPE of 1000
pieces learned here from the text), decoded greedily with outputs of at most
1 token, so that a million lines take minutes: what is measured is what
the input's length can change (the lines, their ids, their results), not a
model's working set, which a window bounds in the same way.

    python benchmarks/translate_stream_memory.py --text ../shared/data/multi30k/train.en
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
from pathlib import Path

import torch

from transformer_mt.checkpoint import Checkpoint, write_checkpoint
from transformer_mt.config import Config, load_config
from transformer_mt.data.bpe import load_bpe, train_bpe
from transformer_mt.data.clean import normalize
from transformer_mt.model.transformer import Transformer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from translate_memory import measure  # noqa: E402  (wall seconds and peak RSS of a command, as that benchmark)

SHARED_TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k" / "train.en"


def tiny_checkpoint(text: Path, directory: Path) -> Path:
    """An untrained d_model-32 model on a 1000-piece BPE of ``text``, greedy, outputs of at most 1 token."""
    sample = directory / "sample.txt"
    sample.write_text("".join(normalize(line) + "\n" for line in text.read_text(encoding="utf-8").splitlines()))
    spm_path = train_bpe(sample, directory / "spm", vocab_size=1000, character_coverage=1.0)
    cfg: Config = load_config(
        None,
        ["model.d_model=32", "model.d_ff=64", "model.heads=2", "model.encoder_layers=1", "model.decoder_layers=1",
         "decode.beam_size=1", "decode.max_len_a=0", "decode.max_len_b=1", "decode.batch_tokens=8000"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(cfg.model, load_bpe(spm_path).get_piece_size())
    path = directory / "tiny.pt"
    write_checkpoint(path, Checkpoint(model.state_dict(), cfg, spm_path.read_bytes()))
    return path


def repeated(text: Path, lines: int, path: Path) -> Path:
    """The first ``lines`` lines of ``text`` repeated end to end, written to ``path``."""
    source = text.read_text(encoding="utf-8").splitlines()
    with path.open("w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in itertools.islice(itertools.cycle(source), lines))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", type=Path, default=SHARED_TEXT, help="lines to repeat (default Multi30k train.en)")
    parser.add_argument("--small", type=int, default=10_000, help="lines of the short input")
    parser.add_argument("--large", type=int, default=1_000_000, help="lines of the long input")
    parser.add_argument("--window-lines", type=int, default=None, help="tmt translate --window-lines (its default)")
    parser.add_argument("--quantize", choices=["none", "int8"], default="none", help="tmt translate --quantize")
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    tmp = Path(tempfile.mkdtemp())
    ckpt = tiny_checkpoint(args.text, tmp)
    window = [] if args.window_lines is None else ["--window-lines", str(args.window_lines)]
    peaks = {}
    print(f"{'lines':>10} {'wall s':>8} {'lines/s':>8} {'peak RSS MiB':>13}")
    for n in (args.small, args.large):
        src = repeated(args.text, n, tmp / f"in.{n}.en")
        cmd = [sys.executable, "-m", "transformer_mt", "translate", "-c", str(ckpt), "-i", str(src),
               "-o", str(tmp / f"out.{n}.de"), "--device", "cpu", "--quantize", args.quantize, *window]  # fmt: skip
        wall, peak = measure(cmd, env)
        peaks[n] = peak
        print(f"{n:>10} {wall:>8.1f} {n / wall:>8.0f} {peak:>13.0f}")
        src.unlink()
    ratio = peaks[args.large] / peaks[args.small]
    print(f"peak ratio {args.large} / {args.small} lines: {ratio:.2f}x (goal <= 1.2x)")


if __name__ == "__main__":
    main()
