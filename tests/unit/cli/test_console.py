"""The console for people (spmd.rundir.console): which log records reach the terminal and
which stay in the rank log, the phase lines, the progress (a rich bar on a terminal, plain
lines otherwise), `spmd run`'s filter of the ranks' output, `-v`, and `spmd --version`."""

from __future__ import annotations

import importlib.metadata
import io
import logging
import subprocess
import sys

import pytest
from rich.console import Console

from spmd.cli.main import build_parser
from spmd.cli.rank_output import OutputFilter, console_env
from spmd.cli.train_cmd import verbose_overrides
from spmd.rundir.console import CONSOLE_VAR, Narrator, Progress, is_terminal, phase_line
from spmd.rundir.metrics import EventLog, setup_logging
from tests.helpers.env import REPO, clean_env

SAVED = {"tier": "local", "step": 10, "mode": "async", "seconds": 0.18,
         "snapshot": "alias", "shared": True, "params_finite": True}


@pytest.fixture
def logs(tmp_path, capsys):
    """setup_logging(rank, log_level) into tmp_path; the root logger is put back after."""
    root, own = logging.getLogger(), logging.getLogger("spmd")
    before, level, own_level = list(root.handlers), root.level, own.level

    def setup(rank: int = 0, log_level: str = "info"):
        return setup_logging(tmp_path / f"r{rank}{log_level}", rank, log_level=log_level)

    yield setup
    for h in list(root.handlers):
        if getattr(h, "_spmd", False):
            root.removeHandler(h)
            h.close()
    for h in before:
        if h not in root.handlers:
            root.addHandler(h)
    root.setLevel(level)
    own.setLevel(own_level)


def emit_run(path, rank: int) -> None:
    events = EventLog(path.parent / "events.jsonl", rank)
    events.emit("started", launcher="hydra", size=2, nodes=2, process_start=0.0)
    events.emit("saved", **SAVED)
    logging.getLogger("spmd.checkpoint").info("checkpoints: local tier /x (every 10 steps)")
    logging.getLogger("spmd.rundir.lease").info("released the lease /x/lease.json")
    logging.getLogger("spmd.loop.trainer").warning("a warning for everyone")
    events.close()


def test_key_value_records_go_to_the_rank_log_not_the_console(logs, capsys):
    path = logs(rank=0)
    emit_run(path, 0)
    console, log = capsys.readouterr().err, path.read_text()
    # the rank log keeps everything, in its own format
    assert "INFO spmd: saved tier=local step=10 mode=async" in log
    assert "snapshot=alias shared=True params_finite=True" in log
    assert "released the lease" in log and "checkpoints: local tier" in log
    # the console: the save in words, the other lines for people, the warning; no key=value
    assert "tier=local" not in console and "snapshot=alias" not in console
    assert "released the lease" not in console and "launcher=hydra" not in console
    assert phase_line("save step 10", 0.18, "local tier") in console
    assert "bootstrap" in console and "2 processes (hydra)" in console
    assert "checkpoints: local tier /x (every 10 steps)\n" in console   # as it is, no prefix
    assert "WARNING spmd.loop.trainer: a warning for everyone" in console
    # the narrated line is the console's: the rank log has the event's own record
    assert "save step 10" not in log


def test_log_level_debug_shows_the_key_value_records_on_the_console(logs, capsys):
    path = logs(rank=0, log_level="debug")
    emit_run(path, 0)
    logging.getLogger("spmd.checkpoint").debug("a debug record of spmd")
    logging.getLogger("asyncio").debug("a debug record of a library")
    console = capsys.readouterr().err
    assert "INFO spmd: saved tier=local step=10 mode=async" in console
    assert "released the lease" in console
    assert phase_line("save step 10", 0.18, "local tier") in console
    # spmd's DEBUG records too, in the rank log's format; not every library's
    assert "DEBUG spmd.checkpoint: a debug record of spmd" in console
    assert "a debug record of spmd" in path.read_text()
    assert "a debug record of a library" not in console + path.read_text()


def test_other_ranks_show_only_warnings_on_the_console(logs, capsys):
    path = logs(rank=1)
    emit_run(path, 1)
    console = capsys.readouterr().err
    assert console.strip().splitlines() == [
        line for line in console.strip().splitlines() if "WARNING" in line]
    assert "a warning for everyone" in console
    assert "saved tier=local" in path.read_text()


def test_phase_lines_align_the_seconds():
    assert phase_line("compile", 12.34) == "compile" + " " * 13 + "    12.3 s"
    line = Narrator().line("restored", {"step": 200, "source": "local", "seconds": 1.1})
    assert line == (logging.INFO, phase_line("restore step 200", 1.1, "from local"))
    assert line[1].startswith("restore step 200") and line[1].endswith("1.1 s  from local")
    assert Narrator().line("lease_acquired", {"path": "x"}) is None


def test_verbose_flag_sets_run_log_level_debug():
    parser = build_parser()
    for argv in (["train", "c.yaml", "train.steps=3", "-v"], ["run", "-n", "2", "c.yaml", "-v"]):
        args = parser.parse_args(argv)
        assert verbose_overrides(args)[-1] == "run.log_level=debug"
    args = parser.parse_args(["train", "c.yaml", "train.steps=3"])
    assert verbose_overrides(args) == ["train.steps=3"]


def test_plain_lines_without_a_terminal(monkeypatch):
    monkeypatch.setenv(CONSOLE_VAR, "plain")
    out = io.StringIO()
    progress = Progress(100, 0, stream=out, every_s=3600)
    assert not progress.terminal
    for step in range(10, 101, 10):
        progress.advance(step)          # no-op without a terminal
        progress.update(step, 1.0 / step, 1234.5, 60.0)
    progress.close()
    lines = out.getvalue().splitlines()
    # the first logged step, then none within every_s, and always the last
    assert [line.split()[1] for line in lines] == ["10/100", "100/100"]
    assert lines[0] == "step 10/100  loss 0.1000  1,234 samples/s  ETA 1m00s"
    assert "\x1b[" not in out.getvalue()


def test_rich_progress_bar_on_a_terminal():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120, color_system="standard")
    progress = Progress(100, 0, terminal=True, console=console)
    for step in range(1, 51):
        progress.advance(step)
    progress.update(50, 0.1234, 987.0, 30.0)
    progress.close()
    text = out.getvalue()
    assert "\x1b[" in text                       # drawn with terminal control codes
    assert "train" in text and "50/100" in text
    assert "loss 0.1234" in text and "987 samples/s" in text and "ETA" in text


def test_terminal_or_not_from_spmd_console(monkeypatch):
    monkeypatch.setenv(CONSOLE_VAR, "tty")
    assert is_terminal(io.StringIO())
    monkeypatch.setenv(CONSOLE_VAR, "plain")
    assert not is_terminal(io.StringIO())
    monkeypatch.delenv(CONSOLE_VAR)
    assert not is_terminal(io.StringIO())
    # spmd run tells the ranks what its own stderr is; a value the user set stays
    assert console_env({}, io.StringIO())[CONSOLE_VAR] == "plain"
    assert console_env({CONSOLE_VAR: "tty"}, io.StringIO())[CONSOLE_VAR] == "tty"


def test_spmd_run_leaves_out_gloos_connection_lines_only():
    ok = (b"[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer "
          b"ranks is : 1\n")
    short = ok.replace(b"connected to 1", b"connected to 0")
    keep = OutputFilter()
    chunks = [b"spmd run: 2 ranks\n[Gl", b"oo] Rank 1", ok[13:], b"\rstep 1/10",
              b"\rstep 2/10\n", short, b"[Gloo] error: connection refused\n", ok, b"tail"]
    out = b"".join(keep.feed(c) for c in chunks) + keep.flush()
    assert out == (b"spmd run: 2 ranks\n\rstep 1/10\rstep 2/10\n" + short
                   + b"[Gloo] error: connection refused\ntail")
    # a partial line that cannot become Gloo's passes at once (a progress bar's redraw)
    assert OutputFilter().feed(b"\rtrain 3/10") == b"\rtrain 3/10"
    assert OutputFilter(quiet=False).feed(ok) == ok


def test_spmd_run_leaves_out_gloos_lines_of_two_ranks_interleaved_mid_line():
    """Gloo writes its line in pieces; two ranks' pieces arrive interleaved (seen in CI)."""
    pieces = [[b"[Gloo] Rank ", r, b" is connected to ", b"1", b" peer ranks. ",
               b"Expected number of connected peer ranks is : ", b"1", b"\n"]
              for r in (b"0", b"1")]
    merged = [p for pair in zip(*pieces) for p in pair]   # A, B, A, B, ...
    keep = OutputFilter()
    chunks = [b"compile 2.0 s\n", *merged, b"train 1/3\n"]
    assert b"".join(keep.feed(c) for c in chunks) + keep.flush() == (
        b"compile 2.0 s\ntrain 1/3\n")
    # one line ends before the other (the last piece of rank 1 after rank 0's line end)
    keep = OutputFilter()
    late = [*merged[:-3], merged[-2], merged[-3], merged[-1]]
    assert b"".join(keep.feed(c) for c in late) + keep.flush() == b""
    # Gloo's pieces with something else in them pass, all of it
    mixed = b"[Gloo] Rank 0 is connected to [Gloo] error\n"
    assert OutputFilter().feed(mixed) == mixed


def test_spmd_run_shows_an_error_line_every_rank_prints_alike_once():
    """`spmd run` leaves validating `model:` to the ranks (no JAX import in the launcher), so
    each rank prints the same config error: the console shows it once; other errors pass."""
    bad = b"spmd train: error: command line: model.widht=3: unknown config key 'model.widht'\n"
    other = b"spmd train: error: rank 1 on node2: data/x.h5 does not exist\n"
    keep = OutputFilter()
    out = b"".join(keep.feed(c) for c in [bad, bad[:20], bad[20:], other, b"done\n", other])
    assert out == bad + other + b"done\n"
    assert OutputFilter(quiet=False).feed(bad + bad) == bad + bad


def test_spmd_version_prints_the_versions_and_exits_0():
    r = subprocess.run([sys.executable, "-m", "spmd.cli", "--version"], capture_output=True,
                       text=True, env=clean_env(), cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip()
    assert line.startswith(f"spmd {importlib.metadata.version('spmd-hpc')} (jax ")
    assert f"flax {importlib.metadata.version('flax')}" in line


@pytest.mark.slow
def test_spmd_run_on_a_terminal_draws_the_bar_and_hides_the_records(tmp_path):
    """Two ranks under mpiexec, spmd run's stderr a pseudo-terminal: rank 0's stderr is a
    pipe, yet SPMD_CONSOLE makes it draw the rich bar; the phases are shown, the key=value
    records and Gloo's lines are not (they are in the rank log)."""
    import os
    import pty
    import threading

    from spmd.cli.run_cmd import find_mpiexec
    from spmd.errors import SpmdError

    try:
        find_mpiexec()
    except SpmdError as e:
        pytest.skip(f"no mpiexec: {e}")
    master, slave = pty.openpty()
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:   # EIO: every writer closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "spmd.cli", "run", "-n", "2",
         str(REPO / "configs" / "mlp_tiny.yaml"), f"run.dir={run_dir}", "run.plots=false",
         "checkpoint.persistent_every=0", "checkpoint.final=false"],
        stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=clean_env(COLUMNS="100"),
        cwd=REPO, timeout=300)
    os.close(slave)
    reader.join(timeout=30)
    os.close(master)
    text = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert "\x1b[" in text and "20/20" in text and "samples/s" in text   # the rich bar
    for phase in ("bootstrap", "data", "init", "compile", "training", "finished at step 20"):
        assert phase in text, (phase, text[-3000:])
    assert "[Gloo]" not in text and "started launcher=" not in text
    log = (run_dir / "logs" / "rank00000.log").read_text()
    assert "started launcher=hydra" in log and "compiled seconds=" in log
