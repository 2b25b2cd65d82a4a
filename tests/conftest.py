"""Shared fixtures: a tiny prepared toy corpus that training and decoding tests build on."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from transformer_mt.config import Config, load_config
from transformer_mt.data.prepare import prepare_data
from transformer_mt.data.synthetic import write_corpus


def tiny_toy_config(root) -> Config:
    """A config for a tiny toy corpus under ``root`` (nothing written yet)."""
    return load_config(
        None,
        [
            f"data.train={root}/corpus/train",
            f"data.valid={root}/corpus/valid",
            f"data.test={root}/corpus/test",
            f"data.dir={root}/prepared",
            "data.max_len=100",
            "data.workers=1",
            "bpe.vocab_size=300",
            "bpe.sample_sentences=100000",
            "model.d_model=32",
            "model.d_ff=64",
            "model.heads=2",
            "model.encoder_layers=1",
            "model.decoder_layers=1",
            "model.max_positions=256",
            "train.max_tokens=512",
            "train.update_freq=1",
            "train.warmup=10",
            "train.max_updates=20",
            "train.validate_every=10",
            "train.save_every_minutes=0",
            "train.log_every=5",
            f"train.save_dir={root}/run",
            "decode.batch_tokens=1000",
        ],
    )


@pytest.fixture(scope="session")
def prepared_toy(tmp_path_factory) -> Config:
    """A toy corpus (2000 train / 100 valid / 100 test pairs, BPE 300) already prepared; d_model 32, 1+1 layers.

    Session-scoped: treat the files as read-only and copy ``cfg`` with
    ``dataclasses.replace`` to change keys (e.g. a test's own ``train.save_dir``).
    """
    root = tmp_path_factory.mktemp("toy")
    cfg = tiny_toy_config(root)
    write_corpus(root / "corpus", pairs=2000, valid=100, test=100, seed=cfg.train.seed)
    prepare_data(cfg)
    return cfg


@pytest.fixture(scope="session")
def toy_ckpt(prepared_toy: Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight checkpoint on the toy vocabulary with short outputs (at most half the source length + 3
    tokens), so that decoding it takes a moment. Session-scoped: treat it as read-only."""
    import dataclasses

    from helpers import write_checkpoint

    decode = dataclasses.replace(prepared_toy.decode, max_len_a=0.5, max_len_b=3)
    path = tmp_path_factory.mktemp("toy_ckpt") / "ckpt.pt"
    write_checkpoint(dataclasses.replace(prepared_toy, decode=decode), path, seed=0)
    return path


@pytest.fixture
def unprepared_toy(tmp_path) -> Config:
    """A small toy corpus (300 train / 20 valid / 20 test pairs) under ``tmp_path``, not prepared yet; its config."""
    cfg = tiny_toy_config(tmp_path)
    write_corpus(tmp_path / "corpus", pairs=300, valid=20, test=20, seed=cfg.train.seed)
    return cfg


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and do not stall when other processes hold the cores.

    Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def free_port() -> Callable[[], int]:
    """Call it for a free TCP port on localhost: the rendezvous of a process group that a test spawns."""
    return _free_port


@pytest.fixture
def run_recipe(tmp_path) -> Callable[..., tuple[int, str, list[str]]]:
    """``run_recipe(script, *args, env_extra=None)`` runs a recipe script for real in ``tmp_path``, with a
    stand-in `tmt` on PATH that records its arguments: (exit code, stderr, one line per tmt call).

    The recorded calls are the exact stage commands, checked without training anything. ALLOW_CPU=1 lets
    the scripts past their GPU check on a machine without the GPUs asked for; pass ``{"ALLOW_CPU": ""}`` to test it.
    """
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    (bin_dir / "tmt").write_text(f'#!/usr/bin/env bash\necho "$*" >> {log}\n')
    (bin_dir / "tmt").chmod(0o755)

    def run(script: Path, *args: str, env_extra: dict[str, str] | None = None) -> tuple[int, str, list[str]]:
        path = f"{bin_dir}:{os.environ['PATH']}"
        env = {**os.environ, "PATH": path, "PYTHON": sys.executable, "ALLOW_CPU": "1", **(env_extra or {})}
        done = subprocess.run(
            ["bash", str(script), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
        )
        calls = log.read_text().splitlines() if log.exists() else []
        log.unlink(missing_ok=True)
        return done.returncode, done.stderr, calls

    return run


@pytest.fixture(scope="session")
def toy_run(prepared_toy, tmp_path_factory) -> Path:
    """A run directory of `tmt train` (6 updates of the tiny toy model, validated every 3) that `tmt evaluate`
    scored on 10 toy test lines into eval_toy-test/: what `tmt report`, `tmt plot` and `tmt attention` read.

    Session-scoped: treat it as read-only.
    """
    import dataclasses

    from transformer_mt.evaluate import evaluate_checkpoint
    from transformer_mt.train.run_checkpoints import newest_readable
    from transformer_mt.train.trainer import train_model

    root = tmp_path_factory.mktemp("toy_run")
    train = dataclasses.replace(
        prepared_toy.train, save_dir=str(root / "run"), max_updates=6, validate_every=3, log_every=2,
        save_every_updates=3, num_threads=1,
    )  # fmt: skip
    short = dataclasses.replace(prepared_toy.decode, max_len_a=0.5, max_len_b=4)  # an untrained model rarely ends
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_model(dataclasses.replace(prepared_toy, train=train, decode=short))
        test = Path(prepared_toy.data.test)
        for lang in ("en", "de"):
            lines = Path(f"{test}.{lang}").read_text(encoding="utf-8").splitlines()[:10]
            (root / f"head.{lang}").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        (last,) = newest_readable(root / "run", 1)
        evaluate_checkpoint(
            [last], testset="toy-test", src=root / "head.en", ref=root / "head.de", output=root / "run" / "eval_toy-test",
            overrides=["decode.beam_size=2"], device="cpu",
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    return root / "run"


SHARED_MULTI30K = Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"  # beside the repository


@pytest.fixture(scope="session")
def multi30k_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """150 updates of a small post-norm model on Multi30k (joint BPE 8000): real, varied sentences."""
    from transformer_mt.train.trainer import train_model

    if not SHARED_MULTI30K.is_dir():
        pytest.skip("needs the Multi30k files of the shared data directory beside the repository")

    root = tmp_path_factory.mktemp("multi30k")
    overrides = [f"data.{split}={SHARED_MULTI30K / split}" for split in ("train", "valid", "test")] + [
        f"data.dir={root / 'prepared'}", f"train.save_dir={root / 'run'}", "model.d_model=128", "model.d_ff=512",
        "model.encoder_layers=2", "model.decoder_layers=2", "train.max_minutes=0", "train.max_updates=150",
        "train.validate_every=0", "train.save_every_minutes=0", "train.snapshot_span=0", "train.log_every=50",
        "data.workers=1", "train.precision=fp32",  # the same model on CPUs with and without bf16
    ]  # fmt: skip
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "multi30k.yaml", overrides)
    train_model(cfg)
    return max((root / "run").glob("checkpoint_u*.pt"))


@pytest.fixture(scope="session")
def toy_trained_checkpoint(prepared_toy: Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """1500 updates on the toy corpus (a few seconds): translations that end by themselves, and differ.

    Trained in fp32, the precision both engines decode it in. bf16-trained toy models showed a line or two
    whose output differed between the engines, and between test processes: near-ties, which the engines'
    different summation orders break differently.
    """
    from transformer_mt.train.trainer import train_model

    save_dir = tmp_path_factory.mktemp("toy_run")
    train = dataclasses.replace(
        prepared_toy.train, save_dir=str(save_dir), max_updates=1500, lr=0.005, warmup=20, validate_every=0,
        log_every=1000, precision="fp32",
    )  # fmt: skip
    train_model(dataclasses.replace(prepared_toy, train=train))
    return max(save_dir.glob("checkpoint_u*.pt"))
