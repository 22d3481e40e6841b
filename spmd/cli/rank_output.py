"""The ranks' console output under `spmd run`: passed through, less Gloo's chatter.

The ranks' stdout and stderr are pipes to `spmd run`, which copies each one to its own
stream (`copy_output`, a thread per stream) through an `OutputFilter`.

Invariants:
- Every byte of a rank's output reaches the console, as it comes (a progress bar redraws a
  line without ending it), except Gloo's line per rank saying it connected to all its
  peers (`GLOO_CONNECTED`), also when the ranks' lines arrive interleaved mid-line
  (`gloo_lines`); that line with fewer peers than expected is news, and passes. An error
  line that a second rank prints word for word (`spmd train: error: ...`: a config error,
  which every rank meets alike) is shown once. `-v` (`OutputFilter(quiet=False)`) passes
  all.
- Only the start of a line that may become a quiet one ("[Gloo]") or an error line
  ("spmd ") is held, until its end.
- A console that is gone (closed pipe) is drained anyway, so that no rank blocks writing.
- The ranks' stderr is a pipe, so SPMD_CONSOLE tells rank 0 whether `spmd run`'s stderr is a
  terminal (a progress bar) or not (plain lines), and COLUMNS how wide it is
  (`console_env`).
"""

from __future__ import annotations

import os
import re
import shutil
from typing import IO

from spmd.rundir.console import CONSOLE_VAR

# Gloo (the CPU collectives) says this once per rank when it connects; the same with fewer
# peers than expected is news, and passes.
GLOO_CONNECTED = re.compile(rb"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. "
                            rb"Expected number of connected peer ranks is : (\d+)\s*")



def console_env(env: dict[str, str], stream: IO[str]) -> dict[str, str]:
    """`env` with SPMD_CONSOLE (tty | plain: what `stream`, this process's stderr, is) and,
    for a terminal, COLUMNS; values the user set stay."""
    env = dict(env)
    terminal = stream.isatty()
    env.setdefault(CONSOLE_VAR, "tty" if terminal else "plain")
    if terminal:
        env.setdefault("COLUMNS", str(shutil.get_terminal_size().columns))
    return env


# `spmd.cli.main`'s one line for an SpmdError (a config error every rank meets alike)
ERROR_LINE = re.compile(rb"spmd [a-z ]+: error: ")


def _may_be_error(start: bytes) -> bool:
    """Whether the start of a line may become an error line (ERROR_LINE)."""
    return start.startswith(b"spmd ") or b"spmd ".startswith(start)


def quiet_line(line: bytes) -> bool:
    """Whether a complete output line of a rank is one the console goes without."""
    m = GLOO_CONNECTED.fullmatch(line)
    return m is not None and m.group(1) == m.group(2)


# Gloo writes its connected line in seven writes (its std::cout is flushed at each piece), so
# under one launcher the lines of several ranks arrive interleaved mid-line: "[Gloo] Rank
# [Gloo] Rank 01 is connected to  is connected to 11 peer ranks. ...". These are its pieces.
GLOO_PIECES = (b"[Gloo] Rank ", b" is connected to ", b" peer ranks. ",
               b"Expected number of connected peer ranks is : ", b"\n")
_DIGITS = re.compile(rb"\d+")


def gloo_lines(data: bytes) -> int | None:
    """The length of the Gloo connected lines, whole or interleaved, that `data` starts with
    (as many line ends as lines begun); 0 when `data` so far could still be such lines; None
    when it cannot."""
    begun = ended = i = 0
    while i < len(data):
        if m := _DIGITS.match(data, i):
            i = m.end()
            continue
        piece = next((p for p in GLOO_PIECES if data.startswith(p, i)), None)
        if piece is None:
            rest = data[i:]
            return 0 if any(p.startswith(rest) for p in GLOO_PIECES) else None
        i += len(piece)
        begun += piece == GLOO_PIECES[0]
        ended += piece == b"\n"
        if ended > begun:
            return None
        if ended == begun:
            return i
    return 0


class OutputFilter:
    """A rank output stream, chunk by chunk, without its quiet lines (`quiet_line`, and Gloo's
    connected lines of several ranks interleaved: `gloo_lines`) and without an error line
    shown already (`repeated_error`).

    Bytes pass as they come (a progress bar redraws a line without ending it); only the
    start of a line that may become a quiet one ("[Gloo]") or an error line ("spmd ") is held
    until its end."""

    MARK = b"[Gloo]"

    def __init__(self, quiet: bool = True):
        self.quiet = quiet
        self.held = b""        # the start of a line that may be quiet
        self.mid_line = False  # the current line's start was passed on already
        self.errors: set[bytes] = set()  # the error lines shown (ERROR_LINE)

    def feed(self, data: bytes) -> bytes:
        """What of `data` to write now."""
        if not self.quiet:
            return data
        data, self.held = self.held + data, b""
        out = []
        while data:
            if not self.mid_line and data.startswith(self.MARK):
                n = gloo_lines(data)
                if n == 0:
                    self.held = data   # wait for the ends of the lines begun
                    break
                if n is not None and (data.count(self.MARK, 0, n) > 1
                                      or quiet_line(data[:n - 1])):
                    data = data[n:]    # Gloo's lines, all peers connected: left out
                    continue
            line, newline, rest = data.partition(b"\n")
            if self.mid_line:
                out.append(line + newline)
                self.mid_line = not newline
            elif newline:
                if not quiet_line(line) and not self.repeated_error(line):
                    out.append(line + newline)
            elif self.MARK.startswith(line) or _may_be_error(line):
                self.held = line   # wait for its end
            else:
                out.append(line)
                self.mid_line = True
            data = rest
        return b"".join(out)

    def repeated_error(self, line: bytes) -> bool:
        """Whether `line` is an error line (ERROR_LINE) shown once already."""
        if not ERROR_LINE.match(line):
            return False
        line = line.rstrip()
        seen = line in self.errors
        self.errors.add(line)
        return seen

    def flush(self) -> bytes:
        """What is left at the end of the stream."""
        held, self.held = self.held, b""
        return held


def copy_output(source: IO[bytes], target: IO[bytes], keep: OutputFilter) -> None:
    """Copy `source` to `target` through `keep` until its end (a thread per stream). A
    target that is gone (closed pipe) is drained anyway, so that no rank blocks writing."""
    fd = source.fileno()
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:
            data = b""
        out = keep.feed(data) if data else keep.flush()
        if out:
            try:
                target.write(out)
                target.flush()
            except (OSError, ValueError):
                pass
        if not data:
            source.close()
            return
