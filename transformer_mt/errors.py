"""The one kind of error a user can fix: `tmt` prints its message on one line and exits with status 2.

Every stage raises a `UserError` (or a subclass named after the stage, such
as `transformer_mt.config.ConfigError`) for a mistake in what it was given:
a config key, a flag, a file, the machine. Its message is the whole report,
so it names the file (and line, key or flag) at fault and what to do about
it. The command line catches `UserError` in one place and shows no
traceback; any other exception is a bug in tmt and keeps its traceback.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager


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
