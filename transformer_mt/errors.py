"""The one kind of error a user can fix: `tmt` prints its message on one line and exits with status 2.

Every stage raises a `UserError` (or a subclass named after the stage, such
as `transformer_mt.config.ConfigError`) for a mistake in what it was given:
a config key, a flag, a file, the machine. Its message is the whole report,
so it names the file (and line, key or flag) at fault and what to do about
it. The command line catches `UserError` in one place and shows no
traceback; any other exception is a bug in tmt and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix; the message names the file, line, key or flag at fault and the fix."""
