"""benchmarks/train_throughput.py: the synthetic batches and one tiny measurement (the peak table: test_train_gpu_path)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from transformer_mt.config import load_config
from transformer_mt.data.bpe import PAD

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "train_throughput.py"
_spec = importlib.util.spec_from_file_location("train_throughput", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_synthetic_batches_fit_max_tokens_and_lengths():
    batches = bench.synthetic_batches(vocab_size=500, max_tokens=1024, count=5, seed=3)
    assert len(batches) == 5
    for b in batches:
        assert b.src.numel() <= 1024 and b.tgt_out.numel() <= 1024
        lens = (b.tgt_out != PAD).sum(1)
        assert lens.min() >= 11 and lens.max() <= 41  # 10-40 tokens + EOS
        assert b.src.max() < 500 and torch.equal(b.tgt_in != PAD, b.tgt_out != PAD)
    again = bench.synthetic_batches(vocab_size=500, max_tokens=1024, count=5, seed=3)
    assert all(torch.equal(a.src, b.src) for a, b in zip(batches, again, strict=True))


@pytest.mark.parametrize("impl", ["tmt", "torch", "marian"])
def test_one_tiny_measurement(impl):
    if impl == "marian":
        pytest.importorskip("transformers", reason="the marian peer needs the bench extra")
    overrides = ["model.d_model=32", "model.d_ff=64", "model.heads=2", "model.encoder_layers=1",
                 "model.decoder_layers=1", "bpe.vocab_size=200", "train.max_tokens=256"]  # fmt: skip
    cfg = load_config(None, overrides)
    threads = torch.get_num_threads()
    result = bench._measure(impl, cfg.to_dict(), steps=2, warmup=1, seed=1, threads=1)
    torch.set_num_threads(threads)
    assert result["impl"] == impl and result["tgt_tokens_per_s"] > 0 and result["flops_per_s"] > 0
    assert result["peak_memory_bytes"] > 0 and result["tgt_tokens_per_update"] > 50


@pytest.mark.parametrize("has_bf16", [True, False])
def test_default_peers_leave_out_emulated_bf16(monkeypatch, has_bf16):
    """bf16 peers on a CPU that emulates bf16 would only be slow; on a GPU both precisions are measured."""
    monkeypatch.setattr(bench, "cpu_has_bf16", lambda: has_bf16)
    cpu = bench.parse_peers(bench.default_peers(torch.device("cpu")))
    assert [p for _, p in cpu] == (["fp32", "bf16", "fp32", "bf16"] if has_bf16 else ["fp32", "fp32"])
    assert {i for i, _ in cpu} == {"torch", "marian"}
    assert len(bench.parse_peers(bench.default_peers(torch.device("cuda")))) == 4


def test_peers_parse_and_the_ratio_is_to_the_fastest():
    assert bench.parse_peers("torch:fp32,marian:bf16") == [("torch", "fp32"), ("marian", "bf16")]
    assert bench.parse_peers("") == []
    with pytest.raises(SystemExit, match="fairseq:fp32"):
        bench.parse_peers("fairseq:fp32")
    row = {"device": "CPU", "params": 1e6, "tgt_tokens_per_update": 4000, "flops_per_s": 1e9, "mfu": None,
           "peak_memory_bytes": 2**30, "seconds_per_update": 1.0}  # fmt: skip
    results = {
        "tmt": {**row, "precision": "bf16", "tgt_tokens_per_s": 3000.0},
        "torch:fp32": {**row, "precision": "fp32", "tgt_tokens_per_s": 1000.0},
        "marian:fp32": {**row, "precision": "fp32", "tgt_tokens_per_s": 2000.0},
    }
    table = bench.format_table(results)
    assert bench.best_peer(results) == "marian:fp32"
    assert "ratio tmt / fastest peer (marian:fp32), target tokens/s: 1.50" in table
    assert "| marian | fp32 | 2,000 |" in table
