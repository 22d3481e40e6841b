"""The training loop: `Trainer`, its hooks, and the built-in hooks.

Owns: one rank's run from bootstrap to the last save (`trainer`), the hook protocol and
`StepInfo` (`hooks`), preemption, metrics, evaluation, checkpoint and plot hooks
(`builtin_hooks`), the profiler hook (`profiler_hook`) and the MFU of a step
(`throughput`). May import every layer below it (engine, checkpoint, rundir, comm, launch,
config, tasks); only `spmd.aot`, `spmd.api` and `spmd.cli` sit above it.

Named `loop`, not `train`: `spmd.train(...)` is the public function (spmd.api), and a
subpackage of that name would replace it on the `spmd` module once imported.
"""
