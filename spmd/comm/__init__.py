"""Communication between the ranks of a job: agreement and broadcast, with timeouts.

Owns every conversation among ranks above the bootstrap:
- `kvstore`: the one reader of the private jax.distributed key-value client;
- `rank_group`: `RankGroup`, collectives of all ranks (`broadcast_str`, `allreduce_max`)
  over MPI when the job has an MPI world of its size, else over the key-value store;
- `stop_vote`: `StopVote`, every rank stops at the same step for the same reason (the
  preemption agreement over each rank's `spmd.launch.PreemptionWatcher`);
- `agreement`: `Coordinator`, gather-decide-broadcast over the key-value store, callable
  from any thread (the checkpoint's decisions), of typed votes and decisions (`Vote`,
  `Decision`: frozen dataclasses, JSON only inside `Coordinator.agree`);
- `prepare_wait`: `prepare_on_rank0`, rank 0's one-time data preparation before any
  collective, the other ranks waiting for it (launch.prepare_timeout_s) and saying so;
- `host_gather`: `gather_to_host`, whole arrays on every rank's host as numpy, and
  `sync_devices`, a barrier of every device (JAX's `process_allgather` and
  `sync_global_devices`, returning only once no part of them is left running);
- `errors`: `AgreementError`, `AgreementTimeout`.
Every wait is bounded, and its error names the rank, the host and the config key of the
timeout. May import `spmd.launch` (MPI, the LaunchEnv, the preemption watcher) and
`spmd.errors`; nothing above.
"""

from spmd.comm.agreement import Coordinator, Decision, Vote
from spmd.comm.errors import AgreementError, AgreementTimeout
from spmd.comm.rank_group import RankGroup
from spmd.comm.stop_vote import StopVote

__all__ = ["AgreementError", "AgreementTimeout", "Coordinator", "Decision", "RankGroup",
           "StopVote", "Vote"]
