"""The engine: what one config compiles to on one mesh.

Owns: the device mesh (`mesh`), the sharded train state and optimizer (`state`), the jitted
train/eval steps (`step`), config checks for pipelined strategies (`pipeline_checks`) and
`Runtime`, which binds them (`runtime`). May import `spmd.config`, `spmd.tasks`,
`spmd.data`, `spmd.models`, `spmd.sharding`; never the loop, checkpoints or MPI.
"""
