"""The one exception type users see.

Every bad-input path raises `DraftsmithError` with a single line that names the problem and the fix;
the CLI and the train/ entry points print it as `error: ...` and exit with status 2, with no traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class DraftsmithError(Exception):
    """A user-facing error: one line naming what is wrong and how to fix it."""

    exit_code = 2


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse with its errors in the project's form: one `error: ...` line naming the option and where the usage
    is, exit status 2 (argparse's own prints the whole usage block first)."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message}; see `{self.prog} --help`", file=sys.stderr)
        sys.exit(2)
