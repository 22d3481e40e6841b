"""A task whose data preparation on rank 0 takes as long as the test asks (issue 34).

`SlowPrepareTask` is the tiny MLP regression (configs/mlp_tiny.yaml's model section) whose
`prepare(True)` sleeps `SPMD_TEST_PREPARE_S` seconds (default 0), logging a progress line
"making the slow data: I/N" every second as a data generator would. `prepare(False)` (the
other ranks) records that it ran after rank 0 finished, in the log.

    task: tests.helpers.slow_prepare_task:SlowPrepareTask
"""

from __future__ import annotations

import logging
import os
import time

from spmd.tasks.regression import RegressionTask

ENV = "SPMD_TEST_PREPARE_S"
log = logging.getLogger("tests.helpers.slow_prepare_task")


class SlowPrepareTask(RegressionTask):
    """RegressionTask, with a preparation on rank 0 that takes SPMD_TEST_PREPARE_S seconds."""

    def prepare(self, is_coordinator: bool) -> None:
        if not is_coordinator:
            log.info("slow prepare: this rank's share runs after rank 0's")
            return
        seconds = float(os.environ.get(ENV, "0"))
        steps = max(1, round(seconds))
        began = time.monotonic()
        for i in range(steps):
            log.info("making the slow data: %d/%d", i, steps)
            time.sleep(max(0.0, began + seconds * (i + 1) / steps - time.monotonic()))
        log.info("made the slow data in %.1f s", time.monotonic() - began)
