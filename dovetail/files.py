"""Reading a file a user names (a config, a scenario, a checkpoint's JSON): regular files only, each failure a one-line
ValueError naming the file and what to give instead.

Only regular files, because opening a FIFO for reading waits until something writes to it, and a device may never
end: either would hang the command instead of refusing it."""

import os
import stat
from pathlib import Path


def read_text(path: Path, expected: str) -> str:
    """The UTF-8 text of the regular file at `path`; `expected` says what the file should be ("a YAML file")."""
    try:
        # O_NONBLOCK: opening a FIFO returns at once, so that fstat can refuse it; a regular file reads as usual
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except OSError as error:
        raise ValueError(f"{path}: cannot be read: {error.strerror}") from None
    try:
        mode = os.fstat(descriptor).st_mode
        if stat.S_ISDIR(mode):
            raise ValueError(f"{path}: is a directory; give {expected}")
        if not stat.S_ISREG(mode):
            raise ValueError(f"{path}: not a regular file (a FIFO, socket or device); give {expected}")
        with os.fdopen(descriptor, "rb", closefd=False) as file:
            data = file.read()
    except OSError as error:
        raise ValueError(f"{path}: cannot be read: {error.strerror}") from None
    finally:
        os.close(descriptor)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{path}: not UTF-8 text (byte {error.start} is {error.object[error.start]:#04x}); save it as UTF-8"
        ) from None


def one_line(error: BaseException, limit: int = 300) -> str:
    """An exception's message on one line, cut at `limit` characters: torch and pydantic write several lines (a
    state dict that does not fit lists every tensor), an error for the user is one line."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
