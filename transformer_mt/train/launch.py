"""torchrun for ``tmt train --nproc-per-node N``, its failure told in one line.

torchrun reports a rank that ended with its own traceback and a table; when a
rank is killed (out of memory, a signal) it also stops the others at once, so
the survivors rarely get to say anything. This runs torchrun as it is and, when
a rank fails, prints one line naming the rank that ended first and how: a rank
that exited with an error has printed that error itself.

Run as ``python -m transformer_mt.train.launch TORCHRUN-ARGS...``.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def failure_line(error: ChildFailedError) -> str:
    """The rank that ended first, how, and what to do next."""
    rank, failure = error.get_first_failure()
    if failure.exitcode < 0:
        how = f"was killed by {failure.signal_name()}"
        why = " (SIGKILL is often the kernel's out-of-memory killer: see `dmesg`)" if failure.exitcode == -9 else ""
    else:
        how, why = f"exited with status {failure.exitcode}", " (its error is above)"
    return (
        f"rank {rank} (pid {failure.pid}) {how}{why}; torchrun stopped the other ranks. Run the same command "
        "again to resume from the newest checkpoint."
    )


def main(argv: list[str]) -> int:
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        print(f"error: {failure_line(e)}", file=sys.stderr)
        exitcode = e.get_first_failure()[1].exitcode
        return exitcode if exitcode > 0 else 1  # a rank's own error status, else torchrun's 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
