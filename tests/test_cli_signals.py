"""Ctrl-C and SIGTERM at any moment of a command: one line, the shell's status, no output that looks complete.

Real processes and real signals. Python's own KeyboardInterrupt lands where
chance puts it: in a finalizer it was swallowed and `tmt translate -o` wrote
its whole output and exited 0; during the interpreter's teardown the process
was killed with no line; a SIGTERM left the temporary output file behind.
Each child gets SIGINT's default disposition, as a command at a terminal has
(a test run in the background inherits it ignored). No signal comes before
0.25 s: what lands in Python's own start-up (its site module, some 50 ms
here) is the interpreter's, before any of tmt's code runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from transformer_mt.config import Config


def _run(args: list[str], cwd: Path, sig: signal.Signals | None, after: float) -> tuple[int, str, float]:
    """``tmt ARGS`` in ``cwd``, sent ``sig`` ``after`` seconds in; its status, stderr and how long it ran."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "transformer_mt", *args], cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    if sig is not None:
        time.sleep(after)
        proc.send_signal(sig)
    err = proc.communicate(timeout=300)[1]
    return proc.returncode, err, time.monotonic() - start


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith((".tmp", ".old")))


@pytest.fixture(scope="module")
def long_input(prepared_toy: Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy test set 40 times: some seconds of translating."""
    path = tmp_path_factory.mktemp("signals") / "in.en"
    path.write_text(Path(f"{prepared_toy.data.test}.en").read_text(encoding="utf-8") * 40, encoding="utf-8")
    return path


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "after"),
    [(signal.SIGINT, 0.25), (signal.SIGINT, 0.45), (signal.SIGINT, 0.7), (signal.SIGINT, 1.5), (signal.SIGTERM, 0.4),
     (signal.SIGTERM, 1.5)],
)  # fmt: skip
def test_translate_o_stopped_at_any_moment(toy_ckpt: Path, long_input: Path, tmp_path: Path, sig, after) -> None:
    status, err, _ = _run(
        ["translate", "-c", str(toy_ckpt), "-i", str(long_input), "-o", "out.de"], tmp_path, sig, after
    )
    word, code = ("interrupted", 130) if sig == signal.SIGINT else ("terminated", 143)
    assert status == code, err
    assert err.strip().splitlines()[-1] == word and "Traceback" not in err, err
    assert not (tmp_path / "out.de").exists() and _leftovers(tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize("command", ["average", "attention", "export hf"])
def test_a_late_ctrl_c_is_one_line_or_nothing(toy_ckpt: Path, tmp_path: Path, command: str) -> None:
    """Ctrl-C near the end of a short command: either it stops (130, "interrupted", no output) or, when the
    command had ended, the output is whole and the status 0; never a process killed by the signal, silently."""
    pytest.importorskip(
        "matplotlib" if command == "attention" else "safetensors" if command == "export hf" else "torch"
    )
    args = {
        "average": ["average", str(toy_ckpt), str(toy_ckpt), "-o", "out"],
        "attention": ["attention", "-c", str(toy_ckpt), "-t", "The old man sees the red car.", "-o", "out"],
        "export hf": ["export", "hf", "-c", str(toy_ckpt), "-o", "out"],
    }[command]
    status, err, took = _run(args, tmp_path, None, 0)
    assert status == 0, err
    for share in (0.85, 1.0):
        for path in tmp_path.iterdir():
            subprocess.run(["rm", "-rf", str(path)], check=True)
        status, err, _ = _run(args, tmp_path, signal.SIGINT, took * share)
        assert status in (0, 130), (share, status, err)
        assert "Traceback" not in err and _leftovers(tmp_path) == [], err
        if status == 130:
            assert err.strip().splitlines()[-1] == "interrupted" and not (tmp_path / "out").exists(), err
        else:
            assert "interrupted" not in err and (tmp_path / "out").exists(), err


@pytest.mark.parametrize("forget", [False, True])
def test_a_ctrl_c_caught_inside_code_run_as_a_string_keeps_the_status_tmt_chose(tmp_path: Path, forget: bool) -> None:
    """CPython marks a KeyboardInterrupt raised inside ``PyRun_String`` (as pybind11 runs while torch loads) as
    never handled and, under ``python -m``, kills the process with SIGINT at exit: a Ctrl-C that tmt caught and
    told had exited -2, not 130. `__main__.main` ends with `forget_caught_interrupt`; without it (the control
    case) the mark is still there."""
    (tmp_path / "probe.py").write_text(
        "import ctypes, sys\n"
        "from transformer_mt.__main__ import forget_caught_interrupt\n"
        "ctypes.pythonapi.PyRun_SimpleString(b'raise KeyboardInterrupt')  # printed, then caught here\n"
        f"{'forget_caught_interrupt()' if forget else 'pass'}\n"
        "sys.exit(130)\n",
        encoding="utf-8",
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(root)])}
    done = subprocess.run([sys.executable, "-m", "probe"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == (130 if forget else -signal.SIGINT), (done.returncode, done.stderr)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_an_import_stops_the_command_once_the_import_is_over(tmp_path: Path, sig) -> None:
    """A signal raised inside an import may land in a C++ extension's (torch's pybind11 code runs Python while it
    loads), where it aborts the process: status -6 and no line. The handler sends it again once the import is
    over: the module imported whole, then the command stopped."""
    (tmp_path / "slow_import.py").write_text(
        f"import os, time\nos.kill(os.getpid(), {int(sig)})\ntime.sleep(0.3)\nWHOLE = True\n", encoding="utf-8"
    )
    (tmp_path / "probe.py").write_text(
        "import sys, time\n"
        "from transformer_mt.errors import Terminated, stop_on_signals\n"
        "stop_on_signals()\n"
        "try:\n"
        "    import slow_import\n"
        "    time.sleep(5)\n"
        "except (KeyboardInterrupt, Terminated):\n"
        "    print(getattr(sys.modules.get('slow_import'), 'WHOLE', False))\n"
        "    sys.exit(3)\n",
        encoding="utf-8",
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(root)])}
    done = subprocess.run(
        [sys.executable, "probe.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    assert (done.returncode, done.stdout.strip()) == (3, "True"), done.stderr
