"""The run directory: what a run leaves behind, and who may write there.

Owns: the one-writer lease (`lease`), metrics.jsonl / events.jsonl / rank logs
(`metrics`), the PNG curves (`plots`), the experiment trackers (`trackers`), the profiler
trace summary (`trace_summary`) and the goodput ledger with its timeline (`goodput`,
`timeline`), and the `run:` section (`run_config`). May import `spmd.launch`, `spmd.comm`
and `spmd.errors`; it knows no model, task or checkpoint format, and `spmd.config` (which
assembles the `run:` section) sits above it.
"""
