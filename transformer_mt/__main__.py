"""`python -m transformer_mt` runs the `tmt` app; torchrun needs this form (`torchrun -m transformer_mt train ...`).

`main` is also the `tmt` script. It takes over Ctrl-C and SIGTERM before the
command line's imports (a fifth of a second), so that a signal at any moment
is one line and the shell's status (`errors.stop_on_signals`), and ignores
them once the command has ended: a signal while the interpreter tears down
would kill it with no line.
"""

import signal
import sys

from transformer_mt.errors import SIGNAL_EXITS, Terminated, ignore_signals, stop_on_signals


def main() -> None:
    stop_on_signals()
    try:
        from transformer_mt.cli import app

        app()
    except KeyboardInterrupt:  # while the command line was imported
        print("interrupted", file=sys.stderr)
        sys.exit(SIGNAL_EXITS[signal.SIGINT])
    except Terminated:
        print("terminated", file=sys.stderr)
        sys.exit(SIGNAL_EXITS[signal.SIGTERM])
    finally:
        ignore_signals()
        forget_caught_interrupt()


def forget_caught_interrupt() -> None:
    """Let the status tmt chose stand, even after a Ctrl-C it caught inside code that C ran as a string.

    CPython marks a KeyboardInterrupt raised in code run by ``PyRun_String``
    (pybind11 runs such code while torch's extension modules load) as never
    handled, whoever catches it later, and at exit kills its own process with
    SIGINT instead of exiting with the status set: a shell saw a process
    killed by the signal after its "interrupted" line (status -2, not 130).
    Running an empty string the same way clears the mark.
    """
    try:
        import ctypes

        ctypes.pythonapi.PyRun_SimpleString(b"pass")
    except (ImportError, AttributeError, OSError):  # not CPython: it has no such mark
        pass


if __name__ == "__main__":
    main()
