"""Process bootstrap: knows schedulers and MPI, nothing of models.

    env = bootstrap(init_timeout_s, heartbeat_timeout_s)   # every rank, before any JAX use
    watcher = PreemptionWatcher.install(halt_file=run_dir / HALT_FILE_NAME, env=env)
    priority, reason = watcher.request()                    # what this rank alone has seen

Owns what one rank sees of the job, and the `launch:` section (`launch_config`); may import
nothing of the project but `spmd.errors` and `spmd.atomic_write`.
Making every rank agree on a stop at one step is `spmd.comm.StopVote`, a layer up.
"""

from spmd.launch.env import LaunchEnv, resolve_launch_env
from spmd.launch.errors import LaunchError
from spmd.launch.preemption import HALT_FILE_NAME, PreemptionWatcher
from spmd.launch.startup import bootstrap, shutdown
from spmd.launch.walltime import job_end_time

__all__ = ["LaunchEnv", "LaunchError", "resolve_launch_env", "bootstrap", "PreemptionWatcher",
           "HALT_FILE_NAME", "job_end_time", "shutdown"]
