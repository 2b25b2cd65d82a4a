"""Real DDP (gloo, 2 CPU processes): same gradients and update as one process on the union of the batches."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from transformer_mt.config import ModelConfig, TrainConfig
from transformer_mt.data.bpe import BOS, EOS, PAD
from transformer_mt.data.dataset import Batch
from transformer_mt.model.transformer import Transformer
from transformer_mt.train.distributed import DistEnv
from transformer_mt.train.schedule import build_optimizer
from transformer_mt.train.step import Stepper, accumulate_gradients, apply_gradients

VOCAB = 40
MODEL = ModelConfig(d_model=32, d_ff=64, heads=4, encoder_layers=2, decoder_layers=2, dropout=0.0, max_positions=64)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py's: tiny matrices run fastest on one thread


def _batch(seed: int, sentences: int, src_len: int, tgt_len: int) -> Batch:
    """A right-padded batch with ragged lengths, built like `collate` builds them."""
    g = torch.Generator().manual_seed(seed)
    src = torch.full((sentences, src_len), PAD)
    tgt_in = torch.full((sentences, tgt_len), PAD)
    tgt_out = torch.full((sentences, tgt_len), PAD)
    for b in range(sentences):
        s = int(torch.randint(1, src_len, (1,), generator=g))
        t = int(torch.randint(1, tgt_len, (1,), generator=g))
        ids = torch.randint(4, VOCAB, (max(s, t),), generator=g)
        src[b, :s], src[b, s] = ids[:s], EOS
        tgt_in[b, 0], tgt_in[b, 1 : t + 1] = BOS, ids[:t]
        tgt_out[b, :t], tgt_out[b, t] = ids[:t], EOS
    return Batch(src, tgt_in, tgt_out)


# rank 0 gets two batches, rank 1 one batch and an empty filler (a zero-weight step)
SHARDS = {0: [(1, 3, 7, 9), (2, 5, 4, 6)], 1: [(3, 2, 10, 12), None]}


def _shard(rank: int) -> list[Batch | None]:
    return [None if spec is None else _batch(*spec) for spec in SHARDS[rank]]


def _stepper(model, module, env: DistEnv, adam: bool = False, deferred: bool = False) -> Stepper:
    """``deferred``: the GPU's way, counts summed over ranks on the device and a fused optimizer that skips there
    (`step._device_counts`, `step._step`, `step._deferred_stats`), which a single GPU never runs with more than
    one rank."""
    # SGD makes the update linear in the gradient; Adam's first step is lr * sign(g), which turns
    # rounding noise in near-zero gradients into full-size differences.
    if adam:
        opt = build_optimizer(module.parameters(), TrainConfig())
    else:
        opt = torch.optim.SGD(module.parameters(), lr=0.0, fused=deferred or None)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return Stepper(model, module, opt, scaler, env, "fp32", 0.1, clip_norm=0.0, defer_sync=deferred)


def _run_update(step: Stepper, batches: list[Batch | None]) -> tuple[dict, dict, float]:
    stats = accumulate_gradients(step, batches)
    grads = {n: p.grad.clone() for n, p in step.module.named_parameters()}
    apply_gradients(step, stats, lr=0.1)
    params = {n: p.detach().clone() for n, p in step.module.named_parameters()}
    return grads, params, float(stats.loss_sum / stats.tokens)


def _worker(rank: int, world_size: int, port: int, out_dir: str, deferred: bool = False) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        env = DistEnv(rank, world_size, rank, torch.device("cpu"), rank == 0)
        torch.manual_seed(0 if rank == 0 else 123)  # DDP must broadcast rank 0's weights
        module = Transformer(MODEL, VOCAB, PAD)
        step = _stepper(DDP(module), module, env, deferred=deferred)
        grads, params, loss = _run_update(step, _shard(rank))
        torch.save({"grads": grads, "params": params, "loss": loss}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("deferred", [False, True], ids=["host-synced", "deferred"])
def test_two_process_gloo_equals_one_process_on_union(tmp_path, free_port, deferred):
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path), deferred), nprocs=2, join=True)

    torch.manual_seed(0)
    module = Transformer(MODEL, VOCAB, PAD)
    env = DistEnv(0, 1, 0, torch.device("cpu"), True)
    union = [b for rank in (0, 1) for b in _shard(rank) if b is not None]
    grads, params, loss = _run_update(_stepper(module, module, env), union)

    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for name, g in grads.items():
        assert g.abs().sum() > 0, name
        for r in ranks:
            torch.testing.assert_close(r["grads"][name], g, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(r["params"][name], params[name], rtol=1e-5, atol=1e-7)
    assert ranks[0]["loss"] == pytest.approx(loss, rel=1e-6)


def test_gradient_is_mean_over_target_tokens_of_the_whole_update():
    """Accumulating two batches equals one backward of (sum of both losses) / (all their target tokens)."""
    from transformer_mt.train.step import forward_loss

    torch.manual_seed(0)
    module = Transformer(MODEL, VOCAB, PAD)
    env = DistEnv(0, 1, 0, torch.device("cpu"), True)
    batches = _shard(0)
    step = _stepper(module, module, env, adam=True)
    stats = accumulate_gradients(step, batches)
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    assert stats.tokens == sum(b.num_tgt_tokens for b in batches)

    module.zero_grad()
    total = sum(forward_loss(module, b, "fp32", 0.1)[0] for b in batches)
    (total / stats.tokens).backward()
    for n, p in module.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-8)


@pytest.mark.slow
def test_tmt_train_with_torchrun_two_processes(prepared_toy, tmp_path):
    """`tmt train CONFIG --nproc-per-node 2` launches torchrun; rank 0 writes one checkpoint with both ranks' RNG."""
    import dataclasses
    import subprocess
    import sys

    from helpers import load_state

    from transformer_mt.run_names import checkpoint_name

    run = tmp_path / "run"
    cfg = dataclasses.replace(prepared_toy, train=dataclasses.replace(prepared_toy.train, save_dir=str(run)))
    config = tmp_path / "toy.yaml"
    config.write_text(cfg.to_yaml())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "transformer_mt", "train", str(config), "--nproc-per-node", "2"]
    proc = subprocess.run(
        [*cmd, "--set", "train.max_updates=4", "--set", "train.validate_every=2",
         "--set", "train.valid_bleu_sentences=6", "--set", "train.best_metric=bleu"],  # rank 0 decodes, both wait
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = load_state(run / checkpoint_name(4))
    assert state["update"] == 4 and state["rng"]["world_size"] == 2
    cpu0, cpu1 = state["rng"]["torch_cpu"]
    assert not torch.equal(cpu0, cpu1)  # each rank draws its own dropout masks
    assert proc.stderr.count("resolved config") == 1 and proc.stderr.count("done at update 4") == 1
    metrics = (run / "metrics.jsonl").read_text().splitlines()
    assert sum('"kind": "valid"' in line for line in metrics) == 2  # written once, by rank 0
    assert sum('"bleu_sentences": 6' in line for line in metrics) == 2 and "best_valid_bleu" in state


def _prepare_worker(rank: int, port: int, cfg_dict: dict, out_dir: str) -> None:
    """One rank of a run whose data is not prepared yet; rank 0's preparation outlasts the collective timeout."""
    import datetime
    import time

    from transformer_mt.config import config_from_dict
    from transformer_mt.data import prepare
    from transformer_mt.train.build import prepare_on_rank0

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=2))
    real = prepare.prepare_data

    def slow_prepare(cfg, force=False):
        time.sleep(4)  # as WMT would, at scale: longer than the process group's timeout
        return real(cfg, force)

    prepare.prepare_data = slow_prepare
    try:
        data_dir = prepare_on_rank0(config_from_dict(cfg_dict), DistEnv(rank, 2, rank, torch.device("cpu"), rank == 0))
        dist.barrier()  # both ranks still in the process group: nobody timed out
        Path(out_dir, f"rank{rank}").write_text(str(data_dir))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_wait_for_rank_0_to_prepare_outside_any_collective(unprepared_toy, tmp_path, free_port):
    """With a 2 s collective timeout and a 4 s preparation, rank 1 polls for the data instead of timing out."""
    from transformer_mt.data.prepare import is_prepared

    cfg = unprepared_toy
    args = (free_port(), cfg.to_dict(), str(tmp_path))
    mp.spawn(_prepare_worker, args=args, nprocs=2, join=True)
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == [cfg.data.dir, cfg.data.dir]
    assert is_prepared(cfg)


@pytest.mark.slow
def test_a_rank_whose_peer_ended_names_it_in_one_line():
    """Gloo's error names an address; the message names the rank whose process is gone, and only this error."""
    import socket
    import subprocess

    from transformer_mt.train.distributed import peer_ended

    gone = subprocess.Popen(["true"])
    gone.wait()
    host = socket.gethostname()
    env = DistEnv(0, 2, 0, torch.device("cpu"), True, peers=((host, os.getpid()), (host, gone.pid)))
    reset = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:13202: Connection reset by peer.")
    error = peer_ended(reset, env)
    assert error is not None and str(error).startswith(f"rank 0 stopped: rank 1 (pid {gone.pid}) has ended")
    assert "run the same command again" in str(error) and "\n" not in str(error)
    assert peer_ended(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), env) is None
    assert peer_ended(reset, DistEnv(0, 1, 0, torch.device("cpu"), True)) is None  # alone: not a peer's doing
    far = DistEnv(0, 2, 0, torch.device("cpu"), True, peers=((host, os.getpid()), ("node7", 4242)))
    assert "a rank on node7 ended or became unreachable" in str(peer_ended(reset, far))


def _pids_with(tag: str, local_rank: int) -> list[int]:
    """The processes started with TMT_TEST_TAG=tag (inherited from the test's launcher) and this LOCAL_RANK."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            env = environ.read_bytes().split(b"\0")
        except OSError:
            continue
        if f"TMT_TEST_TAG={tag}".encode() in env and f"LOCAL_RANK={local_rank}".encode() in env:
            found.append(int(environ.parent.name))
    return found


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the rank's process through /proc")
def test_killing_one_rank_gives_the_other_one_line_naming_it(prepared_toy, tmp_path):
    """`kill -9` of rank 1 under `tmt train --nproc-per-node 2`: one line names rank 1, and no traceback."""
    import dataclasses
    import signal
    import subprocess
    import sys
    import time
    import uuid

    run = tmp_path / "run"
    train = dataclasses.replace(prepared_toy.train, save_dir=str(run), max_updates=100_000, log_every=1)
    config = tmp_path / "toy.yaml"
    config.write_text(dataclasses.replace(prepared_toy, train=train).to_yaml())
    tag = uuid.uuid4().hex
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMT_TEST_TAG": tag}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "transformer_mt", "train", str(config), "--nproc-per-node", "2"]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (run / "metrics.jsonl").is_file() or '"kind": "train"' not in (run / "metrics.jsonl").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        (victim,) = _pids_with(tag, 1)
        os.kill(victim, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1
    # torchrun stops rank 0 at once, or rank 0's next collective fails first: either way one line names rank 1
    named = (f"error: rank 1 (pid {victim}) was killed by SIGKILL", f"error: rank 0 stopped: rank 1 (pid {victim})")
    assert any(line in stderr for line in named), stderr[-3000:]
    assert "Traceback" not in stderr and "Connection reset" not in stderr, stderr[-3000:]
