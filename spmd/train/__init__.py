"""The training loop: `Trainer`, its hooks, and the built-in hooks.

Owns: one rank's run from bootstrap to the last save (`trainer`), the hook protocol and
`StepInfo` (`hooks`), and preemption, metrics, evaluation, checkpoint and plot hooks
(`builtin_hooks`). May import every layer below it (engine, checkpoint, rundir, comm,
launch, config, tasks); only `spmd.api` and `spmd.cli` import it.
"""
