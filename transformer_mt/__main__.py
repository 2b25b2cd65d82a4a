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


if __name__ == "__main__":
    main()
