"""A task whose every rank raises the same Python exception: an error in the user's code.

`FailingTask` is the tiny MLP regression (configs/mlp_tiny.yaml's model section) whose
`prepare` raises `ValueError` on every rank, the same way on any node: the recovery
supervisor must not take it for a lost node (tests/slurm/test_slurm_recovery.py).

    task: tests.helpers.failing_task:FailingTask
"""

from __future__ import annotations

from spmd.tasks.regression import RegressionTask

MESSAGE = "the teacher table has no column 'y' (an error in the task's code)"


class FailingTask(RegressionTask):
    """RegressionTask whose preparation raises on every rank."""

    def prepare(self, is_coordinator: bool) -> None:
        raise ValueError(MESSAGE)
