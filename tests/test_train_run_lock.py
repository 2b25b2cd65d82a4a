"""One trainer per run directory, with real processes: a live holder refuses `tmt train`, a killed one is taken over.

Also the leftovers of a save that a kill interrupted, which the next trainer
removes once the lock is its own.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import run_config

from transformer_mt.config import Config, save_config
from transformer_mt.run_names import checkpoint_name
from transformer_mt.train.distributed import DistEnv
from transformer_mt.train.run_checkpoints import list_checkpoints
from transformer_mt.train.run_lock import LOCK_NAME, RunLock, hold_run_dir
from transformer_mt.train.step import TrainError
from transformer_mt.train.trainer import train_model

pytestmark = pytest.mark.usefixtures("one_thread")

# A process that takes the lock the way `tmt train` does and holds it until its stdin closes.
HOLDER = """
import sys
from pathlib import Path
from transformer_mt.train.run_lock import RunLock
lock = RunLock.take(Path(sys.argv[1]))
print("locked", flush=True)
sys.stdin.read()
lock.release()
"""

# A save killed (SIGKILL) halfway through writing the checkpoint.
KILLED_SAVE = """
import os, signal, sys, torch
from transformer_mt.checkpoint import Checkpoint, write_checkpoint
from transformer_mt.config import Config
def half_then_kill(obj, f):
    f.write(b"half a checkpoint")
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)
torch.save = half_then_kill
write_checkpoint(sys.argv[1], Checkpoint({}, Config(), b"spm"))
"""


def _cfg(cfg: Config, save_dir: Path, **train) -> Config:
    return run_config(cfg, save_dir, **{"max_updates": 1, "validate_every": 100, **train})


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _hold(save_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(save_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=_env(),
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


def _files(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != LOCK_NAME}


@pytest.mark.slow
def test_a_second_tmt_train_is_refused_while_the_first_holds_the_run(prepared_toy, tmp_path):
    """A real second `tmt train` process: one line naming the holder's PID and host, exit 2, the run untouched."""
    run = tmp_path / "run"
    train_model(_cfg(prepared_toy, run))
    before = _files(run)
    config = tmp_path / "toy.yaml"
    save_config(_cfg(prepared_toy, run, max_updates=3), config)
    holder = _hold(run)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "transformer_mt", "train", str(config)],
            env=_env(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        holder.communicate("")
    assert proc.returncode == 2, proc.stderr[-2000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1
    assert f"{run} is in use by another `tmt train` (pid {holder.pid} on host {socket.gethostname()}" in error[0]
    assert "another train.save_dir" in error[0]
    assert _files(run) == before  # no checkpoint, metric line or config.yaml written or pruned


def test_a_lock_left_by_a_killed_trainer_is_taken_over_with_a_note(prepared_toy, tmp_path, capsys):
    run = tmp_path / "run"
    holder = _hold(run)
    holder.kill()  # SIGKILL: no chance to release anything
    holder.wait()
    assert f'"pid": {holder.pid}' in (run / LOCK_NAME).read_text()
    result = train_model(_cfg(prepared_toy, run))
    assert result.update == 1
    err = capsys.readouterr().err
    assert f"note: taking over {run / LOCK_NAME} from pid {holder.pid} on host {socket.gethostname()}" in err
    assert (run / LOCK_NAME).read_text() == ""  # released on a clean exit: the next run has nothing to note
    train_model(_cfg(prepared_toy, run, max_updates=2))
    assert "taking over" not in capsys.readouterr().err


def test_one_process_cannot_take_a_run_twice(tmp_path):
    """flock belongs to an open file, so even a second take in the same process is refused; release frees it."""
    lock = RunLock.take(tmp_path)
    with pytest.raises(TrainError, match=rf"in use by another `tmt train` \(pid {os.getpid()} on host"):
        RunLock.take(tmp_path)
    lock.release()
    RunLock.take(tmp_path).release()


def test_a_run_directory_that_cannot_be_created_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    with pytest.raises(TrainError, match=r"file/run: cannot create the run directory \(Not a directory\)"):
        RunLock.take(tmp_path / "file" / "run")

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "mkdir", full_disk)
    with pytest.raises(TrainError, match=r"run: cannot create the run directory \(No space left on device\); free"):
        RunLock.take(tmp_path / "run")


def test_the_lock_file_is_never_followed_through_a_link(tmp_path):
    outside = tmp_path / "outside"
    outside.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).symlink_to(outside)
    with pytest.raises(TrainError, match="cannot open the run's lock file"):
        RunLock.take(run)
    assert outside.read_text() == "precious"


def test_resume_removes_the_leftovers_of_a_killed_save(prepared_toy, tmp_path, capsys):
    """A save killed mid-write leaves .checkpoint_u*.pt.<hex>.tmp; the next run removes it, and only it."""
    run = tmp_path / "run"
    train_model(_cfg(prepared_toy, run))
    subprocess.run([sys.executable, "-c", KILLED_SAVE, str(run / checkpoint_name(2))], env=_env(), check=False)
    leftovers = list(run.glob(f".{checkpoint_name(2)}.*.tmp"))
    assert len(leftovers) == 1 and leftovers[0].read_bytes() == b"half a checkpoint"
    averaging = run / ".average.pt.0123456789abcdef.tmp"  # `tmt average` may be writing beside a running trainer
    averaging.write_bytes(b"x")
    capsys.readouterr()
    train_model(_cfg(prepared_toy, run, max_updates=2))
    assert not leftovers[0].exists() and averaging.exists()
    assert f"removed 1 temporary file(s) left by an interrupted save: {leftovers[0].name}" in capsys.readouterr().err
    assert [p.name for p in list_checkpoints(run)] == [checkpoint_name(1), checkpoint_name(2)]


def _rank(rank: int, port: int, run: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    env = DistEnv(rank, 2, rank, torch.device("cpu"), rank == 0)
    try:
        with hold_run_dir(Path(run), env):
            outcome = "held"
    except TrainError as err:
        outcome = str(err)
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}").write_text(outcome)


@pytest.mark.slow
def test_under_torchrun_rank_0_takes_the_lock_and_every_rank_learns_the_outcome(tmp_path, free_port):
    run = tmp_path / "run"
    mp.spawn(_rank, args=(free_port(), str(run), str(tmp_path)), nprocs=2, join=True)
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["held", "held"]
    holder = _hold(run)
    try:
        mp.spawn(_rank, args=(free_port(), str(run), str(tmp_path)), nprocs=2, join=True)
    finally:
        holder.communicate("")
    assert f"in use by another `tmt train` (pid {holder.pid} on host" in (tmp_path / "rank0").read_text()
    assert (tmp_path / "rank1").read_text() == f"rank 0 could not lock {run} (its message says why)"
