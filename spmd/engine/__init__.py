"""The engine: what one config compiles to on one mesh.

Owns: the device mesh (`mesh`), the sharded train state and optimizer (`state`), the jitted
train/eval steps (`step`), config checks for pipelined strategies (`pipeline_checks`),
`Runtime`, which binds them (`runtime`), and the sections it builds from (`engine_config`:
`mesh:`, `train:`, and `EngineSections`, the bundle of the four it reads). May import
`spmd.tasks`, `spmd.data`, `spmd.models`, `spmd.optim`, `spmd.sharding`, `spmd.rundir`;
never `spmd.config` (which assembles this layer's sections), the loop, checkpoints or MPI.
"""
