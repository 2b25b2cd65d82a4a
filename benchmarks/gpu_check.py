"""The parts of `benchmarks/gpu_check.sh` that `train_throughput.py` does not cover, and its one table.

    python benchmarks/gpu_check.py ddp --json OUT/ddp.json            # under torchrun --nproc-per-node 1
    python benchmarks/gpu_check.py decode --data ../shared/data --json OUT/decode.json
    python benchmarks/gpu_check.py quickstart --json OUT/quickstart.json
    python benchmarks/gpu_check.py report OUT                          # the table of every JSON in OUT

``ddp``: a few updates of the base shape through DistributedDataParallel over
NCCL (gloo on a CPU), two batches per update so that ``no_sync`` and the
gradient all-reduce both run; target tokens/s. ``decode``: beam 4 over
newstest2014 (``wmt14_en_de/newstest2014.en`` under ``--data``) with a
base-shape model of random weights and a BPE model learned from
newstest2013, for at most ``--seconds``: sentences/s. With random weights a
hypothesis rarely ends early, so outputs run towards the length limit (source
length + 50): the slow end of decoding, a bound rather than a trained model's
pace. ``quickstart``: `tmt quickstart` on the GPU (the toy corpus: prepare,
train, average, translate, score), the trainer's own loop with its prefetched
pinned batches, deferred synchronization and checkpoints, end to end; its
sacreBLEU, updates and training tokens/s. ``--cpu-smoke`` shrinks everything
to seconds on a CPU, to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train_throughput import synthetic_batches  # noqa: E402

from transformer_mt.config import Config, load_config  # noqa: E402
from transformer_mt.data.bpe import PAD, load_bpe, train_bpe  # noqa: E402
from transformer_mt.data.clean import normalize, read_lines  # noqa: E402
from transformer_mt.model.transformer import Transformer  # noqa: E402
from transformer_mt.train.distributed import DistEnv  # noqa: E402
from transformer_mt.train.schedule import build_optimizer  # noqa: E402
from transformer_mt.train.step import Stepper, accumulate_gradients, apply_gradients, resolve_precision  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMOKE_MODEL = ["model.d_model=32", "model.d_ff=64", "model.heads=2", "model.encoder_layers=1",
               "model.decoder_layers=1", "bpe.vocab_size=500", "train.max_tokens=512"]  # fmt: skip


def base_config(smoke: bool, extra: list[str]) -> Config:
    """configs/base.yaml (bf16 on a GPU), or the tiny shape of ``--cpu-smoke``."""
    return load_config(ROOT / "configs" / "base.yaml", [*(SMOKE_MODEL if smoke else []), *extra])


def ddp_step(smoke: bool, updates: int) -> dict[str, Any]:
    """``updates`` timed updates (after one untimed) of two batches each, DDP over NCCL on this process's GPU."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    cuda = torch.cuda.is_available() and not smoke
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        cfg = base_config(smoke, ["train.precision=bf16"] if cuda else [])
        env = DistEnv(dist.get_rank(), dist.get_world_size(), 0, device, dist.get_rank() == 0)
        torch.manual_seed(1)
        module = Transformer(cfg.model, cfg.bpe.vocab_size, PAD).to(device)
        opt = build_optimizer(module.parameters(), cfg.train)
        model = DDP(module, device_ids=[device.index] if cuda else None)
        precision = resolve_precision(cfg.train.precision, device)
        scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        step = Stepper(model, module, opt, scaler, env, precision, cfg.train.label_smoothing, 0.0,
                       defer_sync=bool(opt.defaults.get("fused")) and device.type == "cuda")  # fmt: skip
        batches = synthetic_batches(cfg.bpe.vocab_size, cfg.train.max_tokens, 2 * (updates + 1), seed=1)
        batches = [b.pin_memory() if cuda else b for b in batches]
        pairs = [batches[i : i + 2] for i in range(0, len(batches), 2)]
        apply_gradients(step, accumulate_gradients(step, pairs[0]), 1e-4)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for pair in pairs[1:]:
            stats = apply_gradients(step, accumulate_gradients(step, pair), 1e-4)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tokens = sum(b.num_tgt_tokens for pair in pairs[1:] for b in pair)
        return {
            "part": "ddp", "backend": dist.get_backend(), "world_size": env.world_size, "updates": updates,
            "tgt_tokens_per_s": tokens / seconds, "skipped": float(stats.skipped), "loss_finite": bool(
                torch.isfinite(torch.as_tensor(stats.loss_sum)).item()),
        }  # fmt: skip
    finally:
        dist.destroy_process_group()


def decode_speed(data: Path, smoke: bool, seconds: float, sentences: int) -> dict[str, Any]:
    """Beam 4 over newstest2014 in chunks until ``seconds`` have passed (or ``sentences`` are done)."""
    from transformer_mt.decode.translate import Translator

    test = data / "wmt14_en_de" / "newstest2014.en"
    dev = [data / "wmt14_en_de" / f"newstest2013.{lang}" for lang in ("en", "de")]
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    cfg = base_config(smoke, ["bpe.vocab_size=500" if smoke else "bpe.vocab_size=8000"])
    with tempfile.TemporaryDirectory() as tmp:
        sample = Path(tmp) / "sample.txt"
        sample.write_text("".join(normalize(line) + "\n" for path in dev for line in read_lines(path)), "utf-8")
        bpe = load_bpe(train_bpe(sample, Path(tmp) / "spm", cfg.bpe.vocab_size, 1.0, num_threads=4))
    torch.manual_seed(1)
    model = Transformer(cfg.model, bpe.get_piece_size(), PAD).to(device)
    translator = Translator(model, bpe, cfg, device)
    lines = list(read_lines(test))[:sentences]
    translator.translate_lines(lines[:8])  # warm up kernels and allocator
    if device.type == "cuda":
        torch.cuda.synchronize()
    done, out_tokens, start = 0, 0, time.perf_counter()
    while done < len(lines) and time.perf_counter() - start < seconds:
        chunk = lines[done : done + (50 if smoke else 500)]
        out_tokens += sum(len(bpe.encode(h)) + 1 for h in translator.translate_lines(chunk))
        done += len(chunk)
    elapsed = time.perf_counter() - start
    return {
        "part": "decode", "device": str(device), "beam": cfg.decode.beam_size, "sentences": done,
        "sentences_per_s": done / elapsed, "output_tokens_per_s": out_tokens / elapsed, "seconds": elapsed,
    }  # fmt: skip


def quickstart(smoke: bool) -> dict[str, Any]:
    """`tmt quickstart` in a temporary directory (30 updates with ``smoke``); what it scored, and how fast it trained."""
    from transformer_mt.quickstart import run_quickstart
    from transformer_mt.runs import read_metrics

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        scores = run_quickstart(Path(tmp), ("train.max_updates=30",) if smoke else ())
        records = read_metrics(Path(tmp) / "run" / "metrics.jsonl")
    first, last, train = records["start"][0], records["end"][-1], records["train"][-1]
    return {
        "part": "quickstart", "device": first["device"], "precision": first["precision"], "updates": last["update"],
        "tgt_tokens_per_s": train["tgt_tokens_per_s"],
        "sacrebleu": scores["sacrebleu"]["score"], "seconds": time.perf_counter() - start,
    }  # fmt: skip


def report(out: Path) -> str:
    """One Markdown table of every figure the parts wrote as JSON into ``out``."""
    rows = ["| part | figure |", "| --- | --- |"]
    for path in sorted(out.glob("*.json"), key=lambda p: (not p.stem.startswith("train"), p.stem)):  # training first
        found = json.loads(path.read_text(encoding="utf-8"))
        rows.append(f"| {path.stem} | {_figure(found)} |")
    return "\n".join(rows)


def _figure(found: dict[str, Any]) -> str:
    """The headline of one part's JSON: training (train_throughput.py), ddp or decode, or why it has none."""
    if "error" in found:
        return f"not measured: {found['error']}"
    if "tmt" in found:
        t = found["tmt"]
        mfu = f"{100 * t['mfu']:.1f}%" if t.get("mfu") is not None else "n/a"
        return (
            f"{t['tgt_tokens_per_s']:,.0f} tgt tok/s, MFU {mfu}, peak memory {t['peak_memory_bytes'] / 2**30:.1f} GiB "
            f"({t['device']}, {t['precision']}, {t['timed_updates']} updates of {t['tgt_tokens_per_update']:,.0f})"
        )
    if found.get("part") == "ddp":
        return (
            f"{found['tgt_tokens_per_s']:,.0f} tgt tok/s over {found['backend']} DDP, {found['world_size']} "
            f"process(es), {found['updates']} updates, loss finite: {found['loss_finite']}"
        )
    if found.get("part") == "quickstart":
        return (
            f"sacreBLEU {found['sacrebleu']:.1f} on the toy test set after {found['updates']} updates on "
            f"{found['device']} ({found['precision']}, {found['tgt_tokens_per_s']:,.0f} tgt tok/s at the end), "
            f"{found['seconds']:.0f} s in all"
        )
    if found.get("part") == "decode":
        return (
            f"{found['sentences_per_s']:,.1f} sentences/s, {found['output_tokens_per_s']:,.0f} output tok/s, "
            f"beam {found['beam']}, {found['sentences']} sentences (random weights: long outputs)"
        )
    return json.dumps(found)[:200]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["ddp", "decode", "quickstart", "report"])
    parser.add_argument("out", nargs="?", help="report: the directory of the parts' JSON files")
    parser.add_argument("--json", help="write this part's figures to this JSON file")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU: checks the script only")
    parser.add_argument("--updates", type=int, default=5, help="ddp: timed updates")
    parser.add_argument("--data", default="../shared/data", help="decode: the directory holding wmt14_en_de/")
    parser.add_argument("--seconds", type=float, default=60.0, help="decode: stop after this many seconds")
    parser.add_argument("--sentences", type=int, default=3003, help="decode: at most this many sentences")
    args = parser.parse_args(argv)
    if args.part == "report":
        print(report(Path(args.out)))
        return 0
    if args.part == "ddp":
        found = ddp_step(args.cpu_smoke, args.updates)
    elif args.part == "quickstart":
        found = quickstart(args.cpu_smoke)
    else:
        found = decode_speed(Path(args.data), args.cpu_smoke, args.seconds, args.sentences)
    print(json.dumps(found))
    if args.json and int(os.environ.get("RANK", 0)) == 0:
        Path(args.json).write_text(json.dumps(found, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
