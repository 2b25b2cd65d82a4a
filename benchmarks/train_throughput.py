"""Training throughput of tmt against a plain PyTorch Transformer on identical batches.

    python benchmarks/train_throughput.py configs/base.yaml --set bpe.vocab_size=8000 --set train.max_tokens=4096
    python benchmarks/train_throughput.py configs/multi30k.yaml --set train.precision=bf16 --peers torch:fp32,marian:fp32

Measures one training update at a time (forward, label-smoothed loss, backward,
Adam) on synthetic batches: sentences of 10-40 tokens on each side, token ids
drawn uniformly from the vocabulary (bpe.vocab_size), batched by length to
train.max_tokens exactly as training batches them. Reports target tokens/s,
model FLOPs/s (`flops_per_token`), MFU against the device's bf16 dense peak on
a GPU, and peak memory (RSS on CPU, max_memory_allocated on GPU).

The peers, each at the precisions given by --peers (default fp32 and bf16,
so that the best of each is compared; fp32 alone on a CPU without bf16
instructions, where PyTorch emulates bf16 several times slower than fp32):
the model as most PyTorch users would write it, torch.nn.Transformer
(post-norm, batch_first), one embedding shared by source, target and output
projection, sinusoidal positions; and Hugging Face's MarianMTModel of the
same shape (``marian``, needs the ``bench`` extra), the implementation
behind HF's translation models. Both
take F.cross_entropy(label_smoothing=...) and torch.optim.Adam. Each
implementation runs in its own process (so peak memory is its own), taking
turns for --repeats rounds; the medians and the ratio of tmt to the best
peer are printed. Runs on one busy machine differ by 10-25%, so compare the
ratio within one run, not figures across runs.

``--impl tmt`` measures tmt alone (`benchmarks/gpu_check.sh` does, for base
and big, eager and compiled); ``--max-seconds S`` ends the timed updates
once S seconds have passed, so that a slow device or a long compilation
cannot hold a run up; ``--set train.pad_to_multiple=8`` pads the batches as
training does, which bounds the shapes ``--set train.compile=true`` sees. On
CUDA tmt's update is the trainer's: fused Adam, nothing read back per update.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import resource
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from transformer_mt.config import Config, config_from_dict, load_config
from transformer_mt.data.batching import batch_by_size, ordered_indices, shuffle_batches
from transformer_mt.data.bpe import BOS, EOS, PAD
from transformer_mt.data.dataset import Batch, pad_to_multiple
from transformer_mt.malloc import keep_freed_memory
from transformer_mt.model.transformer import count_parameters, flops_per_token
from transformer_mt.train.build import build_stepper
from transformer_mt.train.distributed import DistEnv
from transformer_mt.train.mfu import peak_tflops
from transformer_mt.train.step import accumulate_gradients, apply_gradients, autocast, cpu_has_bf16, resolve_precision

LENGTHS = (10, 40)  # tokens per sentence on each side, before EOS/BOS


def synthetic_batches(vocab_size: int, max_tokens: int, count: int, seed: int) -> list[Batch]:
    """``count`` padded batches of random sentence pairs (10-40 tokens a side), length-bucketed like training."""
    rng = np.random.default_rng(seed)
    n = max(4 * count * max_tokens // sum(LENGTHS) * 2, 1000)
    src_lens = rng.integers(LENGTHS[0], LENGTHS[1] + 1, n)
    # targets about as long as their sources (as in real parallel text), so batches fill on both sides
    tgt_lens = np.clip(src_lens + rng.integers(-3, 4, n), *LENGTHS)
    src_lens, tgt_lens = src_lens + 1, tgt_lens + 1  # + EOS / BOS, the lengths batching counts
    order = ordered_indices(src_lens, tgt_lens, seed)
    chosen = shuffle_batches(batch_by_size(order, src_lens, tgt_lens, max_tokens), seed, 1)[:count]
    return [_make_batch(rng, src_lens[idx] - 1, tgt_lens[idx] - 1, vocab_size) for idx in chosen]


def _make_batch(rng: np.random.Generator, src_lens: np.ndarray, tgt_lens: np.ndarray, vocab: int) -> Batch:
    b, s, t = len(src_lens), int(src_lens.max()) + 1, int(tgt_lens.max()) + 1
    src = np.full((b, s), PAD, dtype=np.int64)
    tgt_in = np.full((b, t), PAD, dtype=np.int64)
    tgt_out = np.full((b, t), PAD, dtype=np.int64)
    for i, (ls, lt) in enumerate(zip(src_lens, tgt_lens, strict=True)):
        src[i, :ls], src[i, ls] = rng.integers(4, vocab, ls), EOS
        ids = rng.integers(4, vocab, lt)
        tgt_in[i, 0], tgt_in[i, 1 : lt + 1] = BOS, ids
        tgt_out[i, :lt], tgt_out[i, lt] = ids, EOS
    return Batch(torch.from_numpy(src), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out))


class PeerTransformer(nn.Module):
    """The reference: torch.nn.Transformer with tied embeddings and sinusoidal positions (post-norm)."""

    def __init__(self, cfg: Config, vocab_size: int) -> None:
        super().__init__()
        m = cfg.model
        self.d_model = m.d_model
        self.embed = nn.Embedding(vocab_size, m.d_model, padding_idx=PAD)
        nn.init.normal_(self.embed.weight, 0.0, m.d_model**-0.5)
        self.transformer = nn.Transformer(
            d_model=m.d_model, nhead=m.heads, num_encoder_layers=m.encoder_layers,
            num_decoder_layers=m.decoder_layers, dim_feedforward=m.d_ff, dropout=m.dropout, batch_first=True,
        )  # fmt: skip
        pos = torch.arange(m.max_positions)[:, None] * torch.exp(
            torch.arange(0, m.d_model, 2) * (-math.log(10000.0) / m.d_model)
        )
        pe = torch.zeros(m.max_positions, m.d_model)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos), torch.cos(pos)
        self.register_buffer("pe", pe, persistent=False)
        self.drop = nn.Dropout(m.dropout)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.drop(self.embed(tokens) * self.d_model**0.5 + self.pe[: tokens.shape[1]])  # (B, T, D)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        t = tgt_in.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=src.device).triu(1)  # True: may not attend
        src_pad = src.eq(PAD)
        x = self.transformer(
            self._embed(src), self._embed(tgt_in), tgt_mask=causal, src_key_padding_mask=src_pad,
            tgt_key_padding_mask=tgt_in.eq(PAD), memory_key_padding_mask=src_pad, tgt_is_causal=True,
        )  # fmt: skip
        return F.linear(x, self.embed.weight)  # (B, T, V)


class MarianPeer(nn.Module):
    """Hugging Face's MarianMTModel of tmt's shape: post-norm, sinusoidal positions, tied and scaled embeddings."""

    def __init__(self, cfg: Config, vocab_size: int) -> None:
        super().__init__()
        from transformers import MarianConfig, MarianMTModel

        m = cfg.model
        config = MarianConfig(
            vocab_size=vocab_size, decoder_vocab_size=vocab_size, d_model=m.d_model, encoder_layers=m.encoder_layers,
            decoder_layers=m.decoder_layers, encoder_attention_heads=m.heads, decoder_attention_heads=m.heads,
            encoder_ffn_dim=m.d_ff, decoder_ffn_dim=m.d_ff, activation_function="relu", dropout=m.dropout,
            attention_dropout=0.0, activation_dropout=0.0, max_position_embeddings=m.max_positions,
            scale_embedding=True, share_encoder_decoder_embeddings=True, pad_token_id=PAD, eos_token_id=EOS,
            decoder_start_token_id=BOS,
        )  # fmt: skip
        self.model = MarianMTModel(config)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        return self.model(
            input_ids=src, attention_mask=src.ne(PAD), decoder_input_ids=tgt_in, decoder_attention_mask=tgt_in.ne(PAD)
        ).logits  # (B, T, V)


PEERS = {"torch": PeerTransformer, "marian": MarianPeer}


def _peer_update(model, optimizer, batch: Batch, tokens: int, precision: str, eps: float) -> None:
    with autocast(batch.src.device, precision):
        logits = model(batch.src, batch.tgt_in)  # (B, T, V)
    loss = F.cross_entropy(
        logits.float().view(-1, logits.size(-1)), batch.tgt_out.view(-1), ignore_index=PAD, label_smoothing=eps,
        reduction="sum",
    )  # fmt: skip
    (loss / tokens).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _measure(
    impl: str, cfg_dict: dict, steps: int, warmup: int, seed: int, threads: int, max_seconds: float = 0.0
) -> dict[str, Any]:
    """Run in a child process: build ``impl``, train ``warmup`` + ``steps`` updates, time the last ``steps``
    (fewer when ``max_seconds`` > 0 runs out first)."""
    cfg = config_from_dict(cfg_dict)
    if impl == "tmt":
        keep_freed_memory()  # as every tmt command does (TMT_MALLOC=system measures without)
    if threads > 0:
        torch.set_num_threads(threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = resolve_precision(cfg.train.precision, device)
    vocab = cfg.bpe.vocab_size
    batches = synthetic_batches(vocab, cfg.train.max_tokens, warmup + steps, seed)
    limit = cfg.model.max_positions
    batches = [pad_to_multiple(b, cfg.train.pad_to_multiple, limit) for b in batches]
    counts = [b.num_tgt_tokens for b in batches]  # read on the host: no device sync inside the timed updates
    batches = [_placed(b, impl, device) for b in batches]
    torch.manual_seed(seed)
    if impl == "tmt":  # the trainer's own model, optimizer and step (train/build.py)
        step = build_stepper(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=seed)),
                             DistEnv(0, 1, 0, device, True), vocab)  # fmt: skip
        module = step.module

        def update(batch: Batch, tokens: int) -> None:  # the trainer counts a batch's tokens itself
            apply_gradients(step, accumulate_gradients(step, [batch]), lr=1e-4)
    else:
        module = PEERS[impl](cfg, vocab).to(device)
        model = torch.compile(module) if cfg.train.compile else module
        optimizer = torch.optim.Adam(module.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)

        def update(batch: Batch, tokens: int) -> None:
            _peer_update(model, optimizer, batch, tokens, precision, cfg.train.label_smoothing)

    module.train()
    for batch, count in zip(batches[:warmup], counts[:warmup], strict=True):
        update(batch, count)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    timed, tokens = [], 0
    for batch, count in zip(batches[warmup:], counts[warmup:], strict=True):
        update(batch, count)
        timed.append(batch)
        tokens += count  # padding excluded: MFU counts real tokens
        if max_seconds > 0 and time.perf_counter() - start > max_seconds:
            break
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    src_len = sum(b.num_src_tokens for b in timed) / sum(len(b) for b in timed)
    tgt_len = tokens / sum(len(b) for b in timed)
    fpt = flops_per_token(cfg.model, vocab, src_len, tgt_len)
    if device.type == "cuda":
        peak_mem = torch.cuda.max_memory_allocated()
        name = torch.cuda.get_device_name(device)
    else:
        peak_mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        name = f"CPU ({torch.get_num_threads()} threads)"
    return {
        "impl": impl,
        "device": name,
        "precision": precision,
        "params": count_parameters(module),
        "tgt_tokens_per_s": tokens / seconds,
        "flops_per_s": fpt * tokens / seconds,
        "peak_memory_bytes": peak_mem,
        "seconds_per_update": seconds / len(timed),
        "tgt_tokens_per_update": tokens / len(timed),
        "timed_updates": len(timed),
        "compiled": cfg.train.compile,
    }


def _placed(batch: Batch, impl: str, device: torch.device) -> Batch:
    """A batch where its update reads it. On a GPU tmt's step gets it pinned in host memory, as the trainer's
    prefetcher hands it over, and copies it without waiting; a peer's model takes it on the device."""
    if device.type != "cuda":
        return batch
    return batch.pin_memory() if impl == "tmt" else batch.to(device)


def _child(queue: mp.Queue, args: tuple) -> None:
    try:
        queue.put(_measure(*args))
    except BaseException as err:  # report, do not hang the parent
        queue.put({"error": f"{type(err).__name__}: {err}"})


def run_isolated(args: tuple) -> dict[str, Any]:
    """One measurement in a fresh process, so that its peak memory and allocator state are its own."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue, args))
    proc.start()
    result = queue.get()
    proc.join()
    if "error" in result:
        raise RuntimeError(f"{args[0]} failed: {result['error']}")
    return result


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over repeats of each figure; MFU on GPUs with a known peak."""
    out = dict(runs[0])
    for key in ("tgt_tokens_per_s", "flops_per_s", "peak_memory_bytes", "seconds_per_update"):
        out[key] = statistics.median(r[key] for r in runs)
    peak = peak_tflops(out["device"]) if "CPU" not in out["device"] else None
    out["mfu"] = out["flops_per_s"] / (peak * 1e12) if peak else None
    return out


def format_one(tmt: dict[str, Any]) -> str:
    """The figures of tmt alone (``--impl tmt``), as a table of one row."""
    mfu = f"{100 * tmt['mfu']:.1f}%" if tmt["mfu"] is not None else "n/a"
    return "\n".join([
        f"device: {tmt['device']}, precision {tmt['precision']}, {tmt['params'] / 1e6:.1f}M parameters, "
        f"{tmt['tgt_tokens_per_update']:.0f} target tokens per update, compiled: {tmt['compiled']}",
        "",
        "| tgt tok/s | model TFLOP/s | MFU | peak memory | s/update | timed updates |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| {tmt['tgt_tokens_per_s']:,.0f} | {tmt['flops_per_s'] / 1e12:,.1f} | {mfu} | "
        f"{tmt['peak_memory_bytes'] / 2**20:,.0f} MiB | {tmt['seconds_per_update']:.3f} | {tmt['timed_updates']} |",
    ])  # fmt: skip


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """One row per implementation and precision (tmt first), then tmt's ratio to the fastest peer."""
    tmt = results["tmt"]
    lines = [
        f"device: {tmt['device']}, {tmt['params'] / 1e6:.1f}M parameters (tmt), "
        f"{tmt['tgt_tokens_per_update']:.0f} target tokens per update",
        "",
        "| implementation | precision | tgt tok/s | model GFLOP/s | MFU | peak memory | s/update |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        lines.append(
            f"| {name.split(':')[0]} | {r['precision']} | {r['tgt_tokens_per_s']:,.0f} | {r['flops_per_s'] / 1e9:,.1f} "
            f"| {mfu} | {r['peak_memory_bytes'] / 2**20:,.0f} MiB | {r['seconds_per_update']:.3f} |"
        )
    best = best_peer(results)
    ratio = tmt["tgt_tokens_per_s"] / results[best]["tgt_tokens_per_s"]
    lines += ["", f"ratio tmt / fastest peer ({best}), target tokens/s: {ratio:.2f}"]
    return "\n".join(lines)


def best_peer(results: dict[str, dict[str, Any]]) -> str:
    return max((name for name in results if name != "tmt"), key=lambda name: results[name]["tgt_tokens_per_s"])


ALL_PEERS = "torch:fp32,torch:bf16,marian:fp32,marian:bf16"


def default_peers(device: torch.device) -> str:
    """Every peer in fp32 and bf16; on a CPU without bf16 instructions the fp32 ones (emulated bf16 is no peer's
    best, and would take most of the benchmark's time)."""
    if device.type == "cpu" and not cpu_has_bf16():
        return ",".join(p for p in ALL_PEERS.split(",") if p.endswith(":fp32"))
    return ALL_PEERS


def parse_peers(spec: str) -> list[tuple[str, str]]:
    """``torch:fp32,marian:bf16`` -> [("torch", "fp32"), ("marian", "bf16")]; an empty string: no peer."""
    peers = []
    for item in filter(None, spec.split(",")):
        impl, _, precision = item.partition(":")
        if impl not in PEERS or precision not in ("fp32", "bf16", "fp16"):
            raise SystemExit(f"--peers: {item!r} is not IMPL:PRECISION with IMPL in {sorted(PEERS)}")
        peers.append((impl, precision))
    return peers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="YAML config whose model and train sections are measured")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="section.key=value (repeatable)")
    parser.add_argument("--steps", type=int, default=10, help="timed updates per run (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed updates first (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of tmt + peers; medians are reported")
    parser.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: torch's default)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--peers", help="IMPL:PRECISION,... with IMPL torch or marian (default: both, fp32 and bf16; "
                        "fp32 only on a CPU without bf16 instructions)")  # fmt: skip
    parser.add_argument("--impl", choices=["both", "tmt"], default="both", help="tmt: measure tmt alone, no peer")
    parser.add_argument("--max-seconds", type=float, default=0.0, help="end the timed updates after this (0: never)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if args.peers is None:
        args.peers = default_peers(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        print(f"peers: {args.peers}", file=sys.stderr)
    peers = [] if args.impl == "tmt" else parse_peers(args.peers)
    plan = [("tmt", "tmt", cfg.to_dict())]
    for impl, precision in peers:
        peer_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=precision))
        plan.append((f"{impl}:{precision}", impl, peer_cfg.to_dict()))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in plan}
    for r in range(args.repeats):
        for name, impl, cfg_dict in plan:
            result = run_isolated((impl, cfg_dict, args.steps, args.warmup, args.seed, args.threads, args.max_seconds))
            runs[name].append(result)
            print(f"round {r + 1}/{args.repeats} {name}: {result['tgt_tokens_per_s']:,.0f} tgt tok/s", file=sys.stderr)
    results = {name: summarize(measured) for name, measured in runs.items()}
    print(format_table(results) if peers else format_one(results["tmt"]))
    if args.json:
        summary = {"tmt": results["tmt"], "peers": {k: v for k, v in results.items() if k != "tmt"}}
        summary["fastest_peer"] = best_peer(results) if peers else None
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({**summary, "runs": runs, "config": cfg.to_dict()}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
