"""Shared fixtures: a tiny prepared toy corpus that training and decoding tests build on."""

from __future__ import annotations

import socket
from collections.abc import Callable

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
