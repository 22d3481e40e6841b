"""In-process stand-ins for what the checkpointer needs of a launch and a run directory."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

# What the checkpointer needs of a LaunchEnv, for a single process (in-process unit tests).
ONE_PROCESS = SimpleNamespace(rank=0, size=1, node_of_rank=(0,), num_nodes=1)


class RecordedEvents:
    """An EventLog stand-in that keeps the emitted events in memory."""

    def __init__(self):
        self.records = []

    def emit(self, event, **fields):
        self.records.append({"event": event, **fields})

    def of(self, name):
        return [r for r in self.records if r["event"] == name]


def one_process_checkpointer(cfg, events: RecordedEvents):
    """The checkpointer of a test config's `checkpoint:` section, in this one process."""
    from spmd.checkpoint import create_checkpointer

    return create_checkpointer(cfg.checkpoint, run_dir=Path(cfg.run.dir), env=ONE_PROCESS,
                               events=events)
