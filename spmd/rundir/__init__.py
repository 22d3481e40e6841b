"""The run directory: what a run leaves behind, and who may write there.

Owns: the one-writer lease (`lease`), metrics.jsonl / events.jsonl / rank logs
(`metrics`) and the PNG curves (`plots`). May import `spmd.launch`, `spmd.comm`,
`spmd.config` and `spmd.errors`; it knows no model, task or checkpoint format.
"""
