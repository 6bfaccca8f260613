"""The one exception type users see.

Every bad-input path raises `DraftsmithError` with a single line that names the problem and the fix;
the CLI and the train/ entry points print it as `error: ...` and exit with status 2, with no traceback.
"""


class DraftsmithError(Exception):
    """A user-facing error: one line naming what is wrong and how to fix it."""

    exit_code = 2
