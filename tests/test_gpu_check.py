"""benchmarks/gpu_check.sh and gpu_check.py, as far as a CPU goes: the refusal without CUDA, the table, and the
DDP and decoding parts shrunk by --cpu-smoke (the GPU figures themselves need a GPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from transformer_mt.train.step import resolve_precision

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
DATA = next((d for d in (ROOT.parent / "shared" / "data", ROOT / "shared" / "data") if d.is_dir()), None)


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.slow
def test_without_cuda_it_stops_at_once_and_says_why(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2 and "no CUDA device" in done.stderr and "--cpu-smoke" in done.stderr
    assert not (tmp_path / "gpu_check").exists()  # nothing measured, nothing written


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.slow
def test_without_python_on_the_path_it_takes_python3(tmp_path):
    bin_dir = tmp_path / "bin"  # a PATH holding python3 (this interpreter, with torch) and no python
    bin_dir.mkdir()
    wrapper = bin_dir / "python3"  # a script, not a link: a virtual environment's python finds itself by its path
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    (bin_dir / "dirname").symlink_to(shutil.which("dirname"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"} | {"PATH": str(bin_dir), "OUT": str(tmp_path)}
    done = subprocess.run([shutil.which("bash"), str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2 and "no CUDA device" in done.stderr  # python3 imported torch and found no GPU


def test_a_python_without_torch_is_named_before_anything_runs(tmp_path):
    env = {**os.environ, "PYTHON": "false", "OUT": str(tmp_path)}  # `false -c "import torch"` fails like it
    done = subprocess.run(["bash", str(SCRIPT), "--cpu-smoke"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2 and "false cannot import torch" in done.stderr and "PYTHON=" in done.stderr
    assert not (tmp_path / "gpu_check").exists()


def test_report_is_one_table_of_every_part(tmp_path):
    train = {"tmt": {"tgt_tokens_per_s": 123456.0, "mfu": 0.512, "peak_memory_bytes": 20 * 2**30,
                     "device": "NVIDIA H200", "precision": "bf16", "timed_updates": 20,
                     "tgt_tokens_per_update": 11000.0}}  # fmt: skip
    ddp = dict(part="ddp", tgt_tokens_per_s=5e4, backend="nccl", world_size=1, updates=5, loss_finite=True)
    decode = dict(part="decode", sentences_per_s=42.0, output_tokens_per_s=3000.0, beam=4, sentences=3003)
    quick = dict(part="quickstart", device="NVIDIA H200", precision="bf16", updates=600, tgt_tokens_per_s=9e4,
                 sacrebleu=67.58, seconds=48.2)  # fmt: skip
    failed = {"part": "train_base_compiled", "error": "failed or ran out of 130s"}
    parts = {"train_big_compiled": train, "ddp": ddp, "decode": decode, "quickstart": quick,
             "train_base_compiled": failed}  # fmt: skip
    for name, found in parts.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(found))
    table = _module().report(tmp_path).splitlines()
    assert table[:2] == ["| part | figure |", "| --- | --- |"] and len(table) == 7
    rows = dict(line.strip("| ").split(" | ", 1) for line in table[2:])
    assert rows["train_big_compiled"].startswith("123,456 tgt tok/s, MFU 51.2%, peak memory 20.0 GiB (NVIDIA H200")
    assert "nccl DDP" in rows["ddp"] and rows["decode"].startswith("42.0 sentences/s")
    assert rows["quickstart"].startswith("sacreBLEU 67.6 on the toy test set after 600 updates on NVIDIA H200 (bf16")
    assert rows["train_base_compiled"].rstrip(" |") == "not measured: failed or ran out of 130s"


@pytest.mark.slow
def test_ddp_part_runs_through_torchrun(tmp_path):
    out = tmp_path / "ddp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(ROOT / "benchmarks" / "gpu_check.py"), "ddp", "--cpu-smoke", "--updates", "2", "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(out.read_text())
    assert (found["backend"], found["world_size"], found["loss_finite"]) == ("gloo", 1, True)
    assert found["tgt_tokens_per_s"] > 0 and found["skipped"] == 0.0


@pytest.mark.skipif(DATA is None, reason="needs the shared data directory (wmt14_en_de/newstest2014.en)")
def test_decode_part_translates_newstest2014(one_thread):
    found = _module().decode_speed(DATA, smoke=True, seconds=30, sentences=6)
    assert found["sentences"] == 6 and found["sentences_per_s"] > 0 and found["beam"] == 4


@pytest.mark.slow
def test_quickstart_part_trains_and_scores(one_thread):
    found = _module().quickstart(smoke=True)
    assert found["updates"] == 30 and found["device"].startswith("CPU")  # precision: auto, bf16 on some CPUs
    assert found["precision"] == resolve_precision("auto", torch.device("cpu"))
    assert 0.0 <= found["sacrebleu"] <= 100.0 and found["tgt_tokens_per_s"] > 0 and found["seconds"] > 0
