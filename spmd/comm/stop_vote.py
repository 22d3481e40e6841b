"""`StopVote`: all ranks agree, at one step, whether to stop, and why.

`should_stop(step)` is a collective every rank calls at every step boundary. It returns
True on every rank at the same step once any rank's `PreemptionWatcher` has a stop request
(a watched signal, the halt file seen by rank 0, the wall-time deadline), and `reason` is
then the same text on every rank. The trainer saves and exits with
`spmd.errors.ExitCode.PREEMPTED` (75); job scripts turn that status into a requeue.

Invariants
- The highest request wins: a signal (the higher number first) over the halt file over the
  deadline, and among equal requests the highest rank; the reason text of that deciding
  rank is what every rank reports.
- Every rank must vote at the same step: a vote whose steps differ fails on every rank
  with a LaunchError instead of stopping ranks at different steps.
- Once True, always True (the decision and its step are kept); a rank that stops voting
  makes the others fail after `group.timeout_s`, never hang (see `RankGroup`).
"""

from __future__ import annotations

from spmd.comm.rank_group import RankGroup
from spmd.launch.errors import LaunchError
from spmd.launch.preemption import PreemptionWatcher

_RANK_BITS = 32  # vote = priority << 32 | rank: the maximum names the deciding rank


class StopVote:
    """This rank's `watcher`, agreed with every other rank's over `group`."""

    def __init__(self, watcher: PreemptionWatcher, group: RankGroup):
        self.watcher, self.group = watcher, group
        self.reason: str | None = None
        self.stop_step: int | None = None

    @property
    def deadline(self) -> float | None:
        """The local watcher's wall-time deadline (epoch seconds; any rank may set it)."""
        return self.watcher.deadline

    @deadline.setter
    def deadline(self, when: float | None) -> None:
        self.watcher.deadline = when

    def should_stop(self, step: int) -> bool:
        """Collective: True on every rank at the same step once any rank has a reason."""
        if self.stop_step is not None:
            return True
        priority, text = self.watcher.request()
        vote = (priority << _RANK_BITS | self.group.env.rank) if priority else 0
        what = f"agree whether to stop at step {step}"
        best, high, minus_low = self.group.allreduce_max([vote, step, -step], what)
        if -minus_low != high:
            raise LaunchError(f"{self.group.env.who}: ranks checked for preemption at different "
                              f"steps ({-minus_low}..{high}); every rank must call should_stop "
                              "at every step")
        if not best:
            return False
        root = best & ((1 << _RANK_BITS) - 1)
        self.reason = self.group.broadcast_str(text, root, "share the stop reason")
        self.stop_step = step
        return True
