"""`spmd run`'s status when the whole job is signalled (issue 38, item 2) or a rank's shim dies
of the signal in its first moment. Fast: the deciding functions alone; the real jobs are in
tests/openmpi/test_open_mpi.py and tests/multiprocess/test_preempt_anytime.py."""

from __future__ import annotations

import signal

import pytest

from spmd.cli.job_status import job_status, killed_starting, received
from spmd.errors import ExitCode

TERM, USR1 = int(signal.SIGTERM), int(signal.SIGUSR1)


@pytest.mark.parametrize("statuses, signalled, expected", [
    # Open MPI: spmd run forwards SIGUSR1, while a whole-job SIGTERM reaches every rank too
    ([75, 143], (USR1, TERM), ExitCode.PREEMPTED),
    ([143, 143], (USR1, TERM), ExitCode.PREEMPTED),
    ([75, 138], (USR1, TERM), ExitCode.PREEMPTED),
    ([143, 69], (USR1, TERM), ExitCode.ORPHANED),       # a rank lost for another cause
    ([143, 143], (int(signal.SIGINT),), ExitCode.ORPHANED),  # not a preemption signal
])
def test_job_status_takes_every_signal_the_ranks_may_have_had(statuses, signalled, expected):
    assert job_status(statuses, 2, signalled) == expected


def test_received_is_the_forwarded_and_the_received_signal():
    assert received({"forwarded": float(USR1), "signal": float(TERM)}) == (USR1, TERM)
    assert received({"forwarded": float(USR1)}) == (USR1,)
    assert received({}) == ()


@pytest.mark.parametrize("statuses, code, signalled, expected", [
    ([75], 15, (TERM, TERM), True),      # Hydra reports the signal its rank died of
    ([], 143, (TERM, TERM), True),       # every shim died of it
    ([0], 15, (TERM, TERM), True),       # the other rank had finished
    ([69], 15, (TERM, TERM), False),     # a rank that failed is not preempted
    ([75], 1, (TERM, TERM), False),      # the launcher names no signal
    ([75], 137, (TERM, TERM), False),    # SIGKILL: not the signal spmd run sent
    ([75], 2, (int(signal.SIGINT),) * 2, False),   # Ctrl-C stays Ctrl-C
    ([75], -15, (TERM, TERM), False),    # mpiexec itself died of it
])
def test_a_rank_whose_shim_died_of_the_signal_counts_as_preempted(statuses, code, signalled,
                                                                   expected):
    assert killed_starting(statuses, code, signalled) is expected
