"""Communication between the ranks of a job: agreement and broadcast, with timeouts.

Owns: the one reader of the jax.distributed key-value client (`kvstore`), and agreement
among ranks (`agreement`): every rank votes, one decision comes back to all, and a rank
that does not answer in time is named. May import `spmd.launch` (MPI, the LaunchEnv) and
`spmd.errors`; nothing above.
"""
