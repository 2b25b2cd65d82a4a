"""glibc's malloc keeps freed memory for tmt's commands (transformer_mt/malloc.py); TMT_MALLOC=system opts out."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from transformer_mt import cli
from transformer_mt.malloc import keep_freed_memory

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
