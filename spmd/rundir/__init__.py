"""The run directory: what a run leaves behind, and who may write there.

Owns: the one-writer lease (`lease`), metrics.jsonl / events.jsonl / rank logs
(`metrics`), the PNG curves (`plots`), the experiment trackers (`trackers`), the profiler
trace summary (`trace_summary`) and the goodput ledger with its timeline (`goodput`,
`timeline`). May import `spmd.launch`, `spmd.comm`, `spmd.config` and `spmd.errors`; it
knows no model, task or checkpoint format.
"""
