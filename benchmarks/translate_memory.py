"""Whole-process wall time and peak resident memory of `tmt translate` beside CTranslate2, on real text.

Each engine runs in a fresh process, as a user runs it; the peak resident
size is the kernel's (``ru_maxrss`` of the waited-for child, `os.wait4`), so
imports, the model and every buffer count. Both decode the same model: the
checkpoint, and its `tmt export ctranslate2` directory (written here when
``--ct2`` is not given), int8, beam 4, fairseq's length penalty, k_finished
stopping, no n-gram block, 4000 source tokens per batch, 2 threads: the
settings of shared/BENCHMARKS.md's real-text comparison. Also reported:
each engine on a single line (what importing the engine and loading the
model cost), the translating speed of each (its whole run less its
single-line run, round by round: what a process already loaded sustains),
and how many lines the two engines translate alike.

    python benchmarks/translate_memory.py -c runs/multi30k/average.pt --text ../shared/data/multi30k/test.en
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = ["--quantize", "int8", "--batch-tokens", "4000", "--set", "decode.len_penalty_form=fairseq",
            "--set", "decode.stopping=k_finished", "--set", "decode.no_repeat_ngram=0"]  # fmt: skip

CT2_SCRIPT = """
import sys, unicodedata, re
import ctranslate2, sentencepiece as spm
directory, src, out, lenpen = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
sp = spm.SentencePieceProcessor(model_file=directory + "/spm.model")
# tmt's normalize (transformer_mt/data/clean.py), restated so that the peer's process imports nothing of tmt
drop = re.compile("[\\x00-\\x08\\x0e-\\x1b\\x7f-\\x84\\x86-\\x9f\\u200b-\\u200d\\u2060\\ufeff\\u00ad]")
lines = [" ".join(drop.sub("", unicodedata.normalize("NFC", l)).split()) for l in open(src, encoding="utf-8").read().split("\\n")[:-1]]
engine = ctranslate2.Translator(directory, device="cpu", compute_type="int8", inter_threads=1, intra_threads=2)
tokens = [sp.encode(l, out_type=str) if l else [] for l in lines]
todo = [i for i, t in enumerate(tokens) if t]
results = engine.translate_batch([tokens[i] for i in todo], beam_size=4, length_penalty=lenpen, max_batch_size=4000,
    batch_type="tokens", max_decoding_length=256, suppress_sequences=[["<pad>"], ["<s>"]])
outputs = [""] * len(lines)
for i, r in zip(todo, results):
    outputs[i] = sp.decode_pieces(r.hypotheses[0])
open(out, "w", encoding="utf-8").write("".join(o + "\\n" for o in outputs))
"""


# Runs the measured command and reports its peak. A child of this process would not do: Python starts children
# with vfork, and the kernel counts the parent's peak (torch imported: 220-370 MiB) into the child's ru_maxrss at
# its exec, a floor under every figure. This small interpreter, without torch, is the parent instead.
_PEAK_OF = """
import os, subprocess, sys
child = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
err = child.stderr.read()
_, status, usage = os.wait4(child.pid, 0)
sys.stderr.buffer.write(err)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)
"""


def measure(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, peak resident MiB) of ``cmd`` run to its end, its peak its own (`_PEAK_OF`)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _PEAK_OF, *cmd], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    code, peak_kib = (int(v) for v in done.stdout.split())
    if code != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {done.stderr}")
    return wall, peak_kib / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--checkpoint", type=Path, required=True)
    parser.add_argument("--text", type=Path, required=True)
    parser.add_argument("--ct2", type=Path, default=None, help="a `tmt export ctranslate2` directory of -c")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each, in turn; the median is reported")
    parser.add_argument("--lenpen", type=float, default=0.6)
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    tmp = Path(tempfile.mkdtemp())
    ct2 = args.ct2 or tmp / "ct2"
    if args.ct2 is None:
        subprocess.run([sys.executable, "-m", "transformer_mt", "export", "ctranslate2", "-c", str(args.checkpoint),
                        "-o", str(ct2)], check=True, env=env, stdout=subprocess.DEVNULL)  # fmt: skip
    one = tmp / "one.en"
    one.write_text(args.text.read_text(encoding="utf-8").split("\n")[0] + "\n", encoding="utf-8")
    tmt = [sys.executable, "-m", "transformer_mt", "translate", "-c", str(args.checkpoint), *SETTINGS,
           "--lenpen", str(args.lenpen)]  # fmt: skip
    runs = {
        "tmt translate --quantize int8": tmt + ["-i", str(args.text), "-o", str(tmp / "tmt.de")],
        "CTranslate2 int8 (Python API)": [
            sys.executable,
            "-c",
            CT2_SCRIPT,
            str(ct2),
            str(args.text),
            str(tmp / "ct2.de"),
            str(args.lenpen),
        ],  # fmt: skip
        "tmt translate of one line": tmt + ["-i", str(one), "-o", str(tmp / "one.de")],
        "CTranslate2 of one line": [
            sys.executable,
            "-c",
            CT2_SCRIPT,
            str(ct2),
            str(one),
            str(tmp / "ct2_one.de"),
            str(args.lenpen),
        ],  # fmt: skip
    }
    found: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, cmd in runs.items():
            found[name].append(measure(cmd, env))
    ours = (tmp / "tmt.de").read_text(encoding="utf-8").split("\n")
    theirs = (tmp / "ct2.de").read_text(encoding="utf-8").split("\n")
    same = sum(a == b for a, b in zip(ours, theirs, strict=True)) - 1  # the split's empty last element
    print(f"{len(ours) - 1} lines, {same} translated alike; medians of {args.rounds} rounds, engines in turn")
    print("| | wall s | peak RSS MiB | all rounds (s / MiB) |\n| --- | --- | --- | --- |")
    for name, values in found.items():
        walls, peaks = sorted(v[0] for v in values), sorted(v[1] for v in values)
        rounds = ", ".join(f"{w:.1f}/{p:.0f}" for w, p in values)
        print(f"| {name} | {walls[len(walls) // 2]:.1f} | {peaks[len(peaks) // 2]:.0f} | {rounds} |")
    lines = len(ours) - 1
    rates = {}
    for engine, whole, single in (("tmt", "tmt translate --quantize int8", "tmt translate of one line"),
                                  ("CTranslate2", "CTranslate2 int8 (Python API)", "CTranslate2 of one line")):  # fmt: skip
        spans = sorted(a[0] - b[0] for a, b in zip(found[whole], found[single], strict=True))
        rates[engine] = lines / spans[len(spans) // 2]
    print(
        f"translating, loaded (whole run less one line's, median): tmt {rates['tmt']:.0f} sentences/s, "
        f"CTranslate2 {rates['CTranslate2']:.0f}: {rates['tmt'] / rates['CTranslate2']:.2f}x"
    )


if __name__ == "__main__":
    main()
