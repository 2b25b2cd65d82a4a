"""glibc's malloc keeps freed memory for tmt's commands (transformer_mt/malloc.py); TMT_MALLOC=system opts out."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from transformer_mt import cli
from transformer_mt.malloc import FreedMemory, keep_freed_memory, release_free_memory

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's options are glibc's")


def _applied(env: dict[str, str]) -> str:
    """keep_freed_memory() in a fresh process (the settings are the process's own), as it printed."""
    code = "from transformer_mt.malloc import keep_freed_memory; print(keep_freed_memory())"
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip


@glibc
def test_glibc_takes_every_setting_and_tmt_malloc_system_keeps_its_defaults() -> None:
    assert _applied({"TMT_MALLOC": ""}) == "True"
    assert _applied({"TMT_MALLOC": "system"}) == "False"


def test_every_command_applies_it(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    calls = []
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: calls.append(1) or True)
    result = CliRunner().invoke(cli.app, ["export", "spm", "-c", str(tmp_path / "none.pt"), "-o", str(tmp_path / "x")])
    assert result.exit_code == 2 and calls == [1]


def test_it_can_be_called_again() -> None:
    first = keep_freed_memory()
    assert keep_freed_memory() == first


RELEASE = """
import torch
from transformer_mt.malloc import FreedMemory, keep_freed_memory, release_free_memory

def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20

keep_freed_memory()  # a trim threshold of 1 GiB: what is freed stays
blocks = [torch.ones(1 << 18) for _ in range(800)]  # 800 blocks of 1 MiB, below the mmap threshold: the heap
held = blocks[::8]  # every eighth stays live, so the freed ones are holes between live blocks
del blocks
before = rss_mb()
released = release_free_memory()
print(released, before - rss_mb(), float(sum(b.sum() for b in held)))
"""


@glibc
@pytest.mark.slow
def test_release_free_memory_gives_the_holes_back() -> None:
    out = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "True" and int(out[1]) > 500  # about 700 MiB of freed blocks behind live ones
    assert float(out[2]) == 100 * (1 << 18)


def test_release_free_memory_leaves_tmt_malloc_system_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMT_MALLOC", "system")
    assert release_free_memory() is False


SLACK = """
import sys
import torch
from transformer_mt.malloc import FreedMemory, keep_freed_memory

def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20

keep_freed_memory()
freed = FreedMemory(slack=int(sys.argv[1]) << 20)
small = [torch.ones(1 << 18) for _ in range(40)]  # 40 MiB, then freed: within a 100 MiB slack
held = small[::8]
del small
quiet = freed.check()
blocks = [torch.ones(1 << 18) for _ in range(400)]  # 400 MiB, below the mmap threshold: the heap
held += blocks[::8]
del blocks
before = rss_mb()
print(quiet, freed.check(), before - rss_mb(), freed.check(), float(sum(b.sum() for b in held)))
"""


@glibc
@pytest.mark.slow
def test_freed_memory_trims_only_past_its_slack() -> None:
    def run(slack_mib: int) -> list[str]:
        cmd = [sys.executable, "-c", SLACK, str(slack_mib)]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()

    quiet, trimmed, given_back, again, total = run(100)
    assert (quiet, trimmed, again) == ("False", "True", "False")  # 35 MiB freed: kept; 350 more: given back, once
    assert int(given_back) > 250
    assert float(total) == (5 + 50) * (1 << 18)
    quiet, trimmed, given_back, *_ = run(1000)  # a slack above what was freed: nothing given back
    assert (quiet, trimmed) == ("False", "False") and int(given_back) < 20


def test_freed_memory_does_nothing_under_tmt_malloc_system(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMT_MALLOC", "system")
    freed = FreedMemory(slack=0)
    assert freed.check() is False
