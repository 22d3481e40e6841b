"""In-process stand-ins for what the checkpointer needs of a launch and a run directory."""

from __future__ import annotations

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
