"""The console for people: what of a rank's log reaches the terminal, the phases of a run
with their elapsed time, and the progress of training (a bar on a terminal, lines otherwise).

Why: a rank's log (run.dir/logs/rank<r>.log) and events.jsonl keep everything, for tools and
for a post-mortem; the terminal, or a batch job's output file, gets what a person reads:
- the phases of rank 0, one line each as it ends, with its elapsed time (`phase_done`;
  `Narrator` for the phases that end in an event of events.jsonl): "compile   12.3 s",
  "restore step 200   1.1 s";
- the other INFO lines of rank 0, and the warnings and errors of every rank;
- the progress of training (`Progress`): a rich progress bar on a terminal, a plain line at
  most every `PLAIN_EVERY_S` (and at the last step) otherwise.
Internal records (an event's `key=value` line, bookkeeping such as the lease's release) go to
the rank log only, unless `run.log_level: debug` (or `-v` on `spmd train` / `spmd run`) asks
for them on the console too (`ConsoleFilter`).

Terminal or not: under mpiexec, srun or jsrun a rank's stderr is a pipe whatever the user
looks at, so `spmd run` says what its own stderr is in SPMD_CONSOLE (`tty` or `plain`, which
a user may also set); without it, whether stderr is a terminal.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import IO, Any

CONSOLE_VAR = "SPMD_CONSOLE"     # tty | plain: what the person's console is (`spmd run` sets it)
INTERNAL = "spmd_internal"       # LogRecord attribute: for the rank log (and a verbose console)
CONSOLE_ONLY = "spmd_console"    # LogRecord attribute: a line for people, already in the log
PLAIN_EVERY_S = 10.0             # plain progress: at most one line per this many seconds
LABEL_WIDTH = 20

people = logging.getLogger("spmd.console")   # the phase lines

# INFO records of these (logger, module) pairs are bookkeeping: the rank log only (module
# None: every module of that logger).
FILE_ONLY_INFO: frozenset[tuple[str, str | None]] = frozenset({
    ("spmd.rundir.lease", None),        # the lease's release (its acquisition is an event)
    ("spmd.checkpoint", "snapshot"),    # the snapshot's buffers (an event says it too)
})


def internal() -> dict[str, bool]:
    """`extra=` of a log call whose record is for the rank log, not the console."""
    return {INTERNAL: True}


def is_terminal(stream: IO[str] | None = None) -> bool:
    """Whether the person's console is a terminal: SPMD_CONSOLE (tty | plain), else whether
    `stream` (default: stderr) is one."""
    mode = os.environ.get(CONSOLE_VAR, "").strip().lower()
    if mode in ("tty", "terminal"):
        return True
    if mode == "plain":
        return False
    stream = stream if stream is not None else sys.stderr
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


# ------------------------------------------------------------------ which records, how


class ConsoleFilter(logging.Filter):
    """What of the log reaches the console: WARNING and above on every rank; on rank 0 the
    INFO records for people too, and with `verbose` every record."""

    def __init__(self, rank: int, verbose: bool = False):
        super().__init__()
        self.rank, self.verbose = rank, verbose

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        if self.rank != 0:
            return False
        if self.verbose:
            return True
        return record.levelno >= logging.INFO and not is_internal(record)


def is_internal(record: logging.LogRecord) -> bool:
    """Whether `record` is bookkeeping for the rank log (`internal()`, `FILE_ONLY_INFO`)."""
    if getattr(record, INTERNAL, False):
        return True
    if record.levelno >= logging.WARNING:
        return False
    return ((record.name, None) in FILE_ONLY_INFO
            or (record.name, record.module) in FILE_ONLY_INFO)


class NotConsoleOnly(logging.Filter):
    """For the rank log: drops the lines for people that repeat what the log holds already
    (an event's `key=value` record, narrated by `Narrator`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, CONSOLE_ONLY, False)


class ConsoleFormatter(logging.Formatter):
    """Lines for people (INFO that is not internal) as they are; warnings, errors and the
    internal and DEBUG records of a verbose console in the rank log's format (time, rank,
    host, level, logger), which says where they come from."""

    def __init__(self, full: logging.Formatter):
        super().__init__("%(message)s")
        self.full = full

    def format(self, record: logging.LogRecord) -> str:
        if record.levelno == logging.INFO and not is_internal(record):
            return super().format(record)
        return self.full.format(record)


class ConsoleHandler(logging.StreamHandler):
    """A stderr handler that writes to the `sys.stderr` of the moment: while the progress bar
    is shown, rich puts a proxy there that prints the line above the bar."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> IO[str]:
        return sys.stderr

    @stream.setter
    def stream(self, value: IO[str]) -> None:
        pass   # always the current sys.stderr


# ------------------------------------------------------------------ phases


def phase_line(label: str, seconds: float | None, detail: str = "") -> str:
    """`label`, the elapsed seconds aligned, then `detail`: "compile        12.3 s"."""
    text = f"{label:<{LABEL_WIDTH}}" + (f"{seconds:>8.1f} s" if seconds is not None else "")
    return f"{text}  {detail}".rstrip() if detail else text.rstrip()


def phase_done(label: str, seconds: float | None, detail: str = "", *,
               level: int = logging.INFO, console_only: bool = False) -> None:
    """A phase that ended, for the console of rank 0 and this rank's log (`console_only`:
    the console alone, for a phase the log records otherwise)."""
    people.log(level, "%s", phase_line(label, seconds, detail),
               extra={CONSOLE_ONLY: console_only})


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _started(f: dict) -> tuple[str, float | None, str]:
    start = f.get("process_start")
    seconds = time.time() - start if isinstance(start, int | float) else None
    size, nodes = f.get("size", 1), f.get("nodes", 1)
    detail = f"{size} process{'es' if size != 1 else ''}"
    if nodes and nodes != size:
        detail += f" on {nodes} node{'s' if nodes != 1 else ''}"
    if f.get("launcher"):
        detail += f" ({f['launcher']})"
    return "bootstrap", seconds, detail


def _evaluated(f: dict) -> tuple[str, float | None, str]:
    shown = [f"{k} {_number(v)}" for k, v in f.items()
             if k not in ("step", "seconds") and isinstance(v, int | float)][:4]
    return f"evaluation step {f.get('step')}", f.get("seconds"), ", ".join(shown)


class Narrator:
    """The phases that end in an event (spmd.rundir.metrics.EventLog), in words: one line for
    the console, not the rank log (which has the event's own record)."""

    def __init__(self) -> None:
        self.process_start: float | None = None

    def line(self, event: str, fields: dict) -> tuple[int, str] | None:
        """The level and the line of `event`, or None for an event not narrated."""
        f = fields
        if event == "started":
            start = f.get("process_start")
            self.process_start = start if isinstance(start, int | float) else None
            out: tuple[str, float | None, str] | None = _started(f)
        elif event == "initialized":
            out = "init", f.get("seconds"), "fresh start at step 0"
        elif event == "restored":
            out = f"restore step {f.get('step')}", f.get("seconds"), f"from {f.get('source')}"
        elif event == "compiled":
            out = "compile", f.get("seconds"), ""
        elif event == "evaluated":
            out = _evaluated(f)
        elif event == "saved":
            out = f"save step {f.get('step')}", f.get("seconds"), f"{f.get('tier')} tier"
        elif event in ("finished", "stopped", "preempted"):
            seconds = (time.time() - self.process_start
                       if self.process_start is not None else None)
            # a stop's reason is logged where it is decided; a preemption's is said here
            reason = f.get("reason") if event == "preempted" else None
            detail = "since the process started" + (f": {reason}" if reason else "")
            out = f"{event} at step {f.get('step')}", seconds, detail
        elif event == "nonfinite_loss":
            return logging.WARNING, f"non-finite loss {f.get('loss')} at step {f.get('step')}"
        else:
            out = None
        if out is None:
            return None
        return logging.INFO, phase_line(*out)

    def __call__(self, event: str, fields: dict) -> None:
        said = self.line(event, fields)
        if said is not None:
            people.log(said[0], "%s", said[1], extra={CONSOLE_ONLY: True})


# ------------------------------------------------------------------ training progress


def duration(seconds: float) -> str:
    """`seconds` in a short form: 42s, 3m05s, 2h13m."""
    seconds = max(int(round(seconds)), 0)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """Training progress on rank 0: steps, loss, samples/s, ETA.

    On a terminal (`terminal`, default `is_terminal()`) a rich progress bar that advances
    every step (`advance`, no device sync) and shows the loss and throughput of the last
    logged step (`update`); log lines print above it. Otherwise a plain line per logged step,
    at most one every `every_s` seconds, and always the last step's: "step 120/300  loss
    0.0412  612 samples/s  ETA 25s". `console`: the rich Console (tests pass their own).
    The ETA is the mean time per step since the first step seen (evaluations and saves
    included) times the steps left; until there is one, the caller's estimate.
    """

    def __init__(self, total: int, start: int, enabled: bool = True, *,
                 terminal: bool | None = None, console: Any = None,
                 stream: IO[str] | None = None, every_s: float = PLAIN_EVERY_S):
        self.enabled, self.total, self.start = enabled, total, start
        self.terminal = is_terminal(stream) if terminal is None else terminal
        self._console, self._stream, self.every_s = console, stream, every_s
        self._bar: Any = None
        self._task: Any = None
        self._last_print: float | None = None
        self._first: tuple[float, int] | None = None   # (time, step) of the first step seen

    def _eta(self, step: int, fallback: float | None) -> float | None:
        now = time.monotonic()
        if self._first is None:
            self._first = (now, step)
        began, first = self._first
        if step <= first:
            return fallback
        return (now - began) / (step - first) * (self.total - step)

    def _start_bar(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        console = self._console or Console(stderr=True, force_terminal=True)
        self._bar = RichProgress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
            TextColumn("{task.fields[eta]}"), console=console, transient=False,
            refresh_per_second=4)
        self._task = self._bar.add_task("train", total=self.total, completed=self.start,
                                        status="", eta="")
        self._bar.start()

    def advance(self, step: int) -> None:
        """The bar's step count (every step; a terminal only)."""
        if not (self.enabled and self.terminal) or step > self.total:
            return
        if self._first is None:
            self._first = (time.monotonic(), step)
        if self._bar is None:
            self._start_bar()
        self._bar.update(self._task, completed=step)

    def update(self, step: int, loss: float, samples_per_s: float,
               eta_s: float | None) -> None:
        """A logged step's loss, throughput and the estimated time left."""
        if not self.enabled:
            return
        status = f"loss {loss:.4f}  {samples_per_s:,.0f} samples/s"
        eta_s = self._eta(step, eta_s)
        eta = f"ETA {duration(eta_s)}" if eta_s is not None else ""
        if self.terminal:
            if self._bar is None:
                self._start_bar()
            self._bar.update(self._task, completed=step, status=status, eta=eta)
            return
        now = time.monotonic()
        if (self._last_print is None or now - self._last_print >= self.every_s
                or step >= self.total):
            stream = self._stream if self._stream is not None else sys.stderr
            print(f"step {step}/{self.total}  {status}  {eta}".rstrip(), file=stream,
                  flush=True)
            self._last_print = now

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
