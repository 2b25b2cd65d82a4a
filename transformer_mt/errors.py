"""The one kind of error a user can fix: `tmt` prints its message on one line and exits with status 2.

Every stage raises a `UserError` (or a subclass named after the stage, such
as `transformer_mt.config.ConfigError`) for a mistake in what it was given:
a config key, a flag, a file, the machine. Its message is the whole report,
so it names the file (and line, key or flag) at fault and what to do about
it. The command line catches `UserError` in one place and shows no
traceback; any other exception is a bug in tmt and keeps its traceback.
"""

from __future__ import annotations

import os
import reprlib
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType


class UserError(Exception):
    """A mistake the user can fix; the message names the file, line, key or flag at fault and the fix."""


def shown(value: object, width: int = 60) -> str:
    """``repr(value)`` for a message, cut to ``width`` characters: a message stays one line, whatever the value.

    A value a user or a file gave may be any size (a YAML alias bomb, a
    crafted checkpoint); `reprlib` cuts containers and strings as it goes,
    so a huge or deeply shared value is never rendered whole, not even in memory.
    """
    text = _REPR.repr(value).replace("\n", " ")
    return text if len(text) <= width else text[: width - 3] + "..."


def _make_repr() -> reprlib.Repr:
    short = reprlib.Repr()
    short.maxlevel, short.maxlist, short.maxtuple, short.maxdict, short.maxset = 2, 4, 4, 4, 4
    short.maxstring = short.maxother = short.maxlong = 60
    return short


_REPR = _make_repr()


class Interrupted(Exception):
    """Ctrl-C, told apart from any failure: the message says where the work stopped and what was kept.

    Not a `UserError`: nothing was wrong. The command line prints the message
    on one line and exits with status 130, the shell's status for SIGINT.
    """


@contextmanager
def out_of_memory(message: Callable[[], str], error: type[UserError] = UserError) -> Iterator[None]:
    """Running out of memory in the block (a GPU's ``torch.OutOfMemoryError``, the host's ``MemoryError`` or
    torch's CPU allocator failing) is ``error(message())``: a setting too large for this machine, not a bug.

    ``message`` names the batch and the setting to lower (training: train.max_tokens; decoding: --batch-tokens).
    The failed batch's tensors are released with the traceback.
    """
    import torch

    try:
        yield
    except (torch.OutOfMemoryError, MemoryError):
        raise error(message()) from None
    except RuntimeError as err:
        if "can't allocate memory" not in str(err):
            raise
        raise error(message()) from None


class Terminated(BaseException):
    """SIGTERM, unwound as Ctrl-C is (temporary files removed on the way out), told apart from it: the command
    line prints "terminated" and exits 143. Not a KeyboardInterrupt: what a command does for a person's Ctrl-C
    (training saves a checkpoint) is not asked of a SIGTERM."""


SIGNAL_EXITS = {signal.SIGINT: 130, signal.SIGTERM: 143}  # 128 + the signal: what a shell reports for each
_RECEIVED: list[int] = []  # process-wide, as the handlers are: the signals `stop_on_signals`' handler has seen


def stop_on_signals(term: bool = True) -> None:
    """Make SIGINT (and SIGTERM, when ``term``) raise KeyboardInterrupt (`Terminated`) and note each one.

    Python raises KeyboardInterrupt itself, but where it lands is chance:
    in a finalizer or a thread's bootstrap it is printed as "ignored" and the
    command goes on to write its whole output, and a SIGTERM kills the process
    with its temporary files left. The note lets a command that comes to its
    end check (`raise_if_stopped`) whether it was interrupted after all,
    before it makes an output look complete. In the main thread only, and
    only where the signal has its default handling: one ignored (a job
    started in the background) stays ignored.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where it was ignored (a background job)
        signal.signal(signal.SIGINT, _stop)
    if term and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _stop)


def _stop(signum: int, frame: FrameType | None) -> None:
    if _importing(frame):
        _deliver_later(signum)
        return
    _RECEIVED.append(signum)
    raise KeyboardInterrupt if signum == signal.SIGINT else Terminated


def _importing(frame: FrameType | None) -> bool:
    """Whether a module is being imported (a frame of importlib's on the stack). An exception raised there may
    land inside a C++ extension's import, as torch's pybind11 code runs Python while it loads, where it cannot
    be caught: the process aborts (status -6, no line) instead of stopping."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _deliver_later(signum: int) -> None:
    """Send ``signum`` to this process again in 50 ms: it stops the command once the import is over (at most the
    import's time late: a second or two for torch)."""
    timer = threading.Timer(0.05, os.kill, (os.getpid(), signum))
    timer.daemon = True
    timer.start()


def stopped_by() -> int | None:
    """The first signal `stop_on_signals`' handler noted, or None."""
    return _RECEIVED[0] if _RECEIVED else None


def raise_if_stopped() -> None:
    """Raise again the interrupt of a signal already received (one that a finalizer may have swallowed): called
    before an output is renamed into place, so that an interrupted command never leaves one that looks complete."""
    if _RECEIVED:
        raise KeyboardInterrupt if _RECEIVED[0] == signal.SIGINT else Terminated


def ignore_signals() -> None:
    """SIGINT and SIGTERM ignored from here on: the command's outcome and status are decided, and a signal while
    the interpreter tears down would kill it with no line (its own handlers are gone by then)."""
    if threading.current_thread() is threading.main_thread():
        for sig in SIGNAL_EXITS:
            signal.signal(sig, signal.SIG_IGN)
