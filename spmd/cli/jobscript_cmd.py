"""`spmd jobscript CONFIG --system S --nodes N --time T [...] [key=value ...]`.

Renders a batch script for a system profile to stdout (or --output), or submits it (--submit),
or submits a chain of K jobs each waiting for the previous one (--chain K). The config is
checked first for the world the script will have (N nodes x the profile's GPUs per node):
mesh axes, train.batch_size over the data-parallel ways, pipeline microbatches, and the
memory of the compiled step (as `spmd plan` does, on stand-in devices; the memory only where
the data set is on this host). A config that would fail at start-up fails here, in one line,
before anything is written or submitted, and not after a wait in the queue. --setup adds the
site's environment set-up (module loads, a virtualenv) to the script, before the launch line.
--spare-nodes K (launch.spare_nodes) holds K more nodes and runs the ranks under the recovery
supervisor, which starts them again in the same job when a node fails (docs/recovery.md).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spmd.hpc.batch_scripts import JobRequest


def _count(option: str, minimum: int = 1):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got '{text}'") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = option
    return parse


def register(sub: argparse._SubParsersAction) -> None:
    from spmd.hpc.systems import SYSTEMS

    p = sub.add_parser(
        "jobscript", help="render (and submit) a batch script for a system profile",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
        epilog="systems: " + "; ".join(f"{n} ({s.scheduler}, {s.description})"
                                       for n, s in SYSTEMS.items()))
    p.add_argument("config", help="YAML config file (checked now, for the job's world)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted config overrides, passed on to `spmd train`")
    p.add_argument("--system", required=True, metavar="S",
                   help=f"system profile: {', '.join(SYSTEMS)}")
    p.add_argument("--nodes", required=True, type=_count("--nodes"), metavar="N",
                   help="nodes to ask for")
    p.add_argument("--time", required=True, metavar="T",
                   help="wall time: MM, H:MM, H:MM:SS or D-H:MM:SS")
    p.add_argument("--account", "-A", metavar="A", help="project / account / bank to charge")
    p.add_argument("--queue", "-q", metavar="Q",
                   help="queue / partition / QOS (default: the profile's, if any)")
    p.add_argument("--ranks-per-node", "--ntasks-per-node", dest="ranks_per_node",
                   type=_count("--ranks-per-node"), metavar="R",
                   help="ranks per node (default: the profile's, one per GPU)")
    p.add_argument("--gpus-per-node", type=_count("--gpus-per-node", 0), metavar="G",
                   help="GPUs per node to request (generic 'slurm' profile)")
    p.add_argument("--spare-nodes", type=_count("--spare-nodes", 0), metavar="K",
                   help="hold K nodes more than --nodes; when a node fails the ranks start "
                        "again on the others and a spare, in the same job (launch.spare_nodes; "
                        "see docs/recovery.md)")
    p.add_argument("--job-name", metavar="NAME", help="default: spmd-<run.dir name>")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="export this in the script too (repeatable)")
    p.add_argument("--setup", action="append", default=[], metavar="LINE|FILE",
                   help="a shell line the script runs before the launch line, e.g. "
                        "--setup 'module load rocm' or --setup 'source venv/bin/activate' "
                        "(repeatable), or a file whose lines it runs; after the profile's "
                        "own set-up lines, before its environment exports")
    p.add_argument("--check", choices=("full", "layout", "none"), default="full",
                   help="what to check for the job's world before rendering: full (default: "
                        "mesh, batch, pipeline, shardings and the compiled step's memory, as "
                        "`spmd plan`), layout (the same without compiling), none (the config "
                        "file and overrides only)")
    p.add_argument("--signal-before", type=_count("--signal-before"), metavar="SECONDS",
                   help="warning signal this long before the time limit (default: 10%% of "
                        "--time, 30 s to 5 min)")
    p.add_argument("--output", "-o", metavar="PATH",
                   help="write the script here (default with --submit: <run.dir>/job.<system>.sh)")
    p.add_argument("--submit", action="store_true", help="submit it and print the job id")
    p.add_argument("--chain", type=_count("--chain"), metavar="K",
                   help="submit K jobs, each starting after the previous one ended; prints ids")
    p.set_defaults(func=run)


def check_for_world(req: JobRequest, config: str, level: str) -> str:
    """The checks of `--check level` for the job's world; SpmdError (one line, naming the
    system and its device count) when the job would fail at start-up; else a summary."""
    from spmd.aot.job_check import check_world
    from spmd.config.load import load_config
    from spmd.errors import SpmdError

    cfg = load_config(req.config, list(req.overrides))
    world = req.describe_world()
    try:
        found = check_world(cfg, req.devices, nodes=req.nodes, system=req.system.name,
                            compile=level == "full", config_name=config)
    except SpmdError as e:
        error = SpmdError(f"{config} for {world}: {e}")
        error.exit_code = e.exit_code
        raise error from None
    for note in found.notes:
        print(f"spmd jobscript: note: {note}", file=sys.stderr)
    return f"checked for {world}: {found.summary()}"


def run(args: argparse.Namespace) -> int:
    from spmd.hpc.batch_scripts import make_request, render, write_script
    from spmd.hpc.job_submit import submit, submit_chain

    req = make_request(
        args.config, system=args.system, nodes=args.nodes, time=args.time,
        overrides=args.overrides, account=args.account, queue=args.queue,
        ranks_per_node=args.ranks_per_node, gpus_per_node=args.gpus_per_node,
        job_name=args.job_name, env=args.env, signal_lead_s=args.signal_before,
        script_path=args.output, setup=args.setup, spare_nodes=args.spare_nodes)
    if args.check != "none":   # before anything is written or submitted
        print(f"spmd jobscript: {check_for_world(req, args.config, args.check)}",
              file=sys.stderr)
    for note in req.notes:
        print(f"spmd jobscript: note: {note}", file=sys.stderr)
    if not (args.submit or args.chain or args.output):
        # The scheduler opens its output file in run.dir before the script runs: make it now,
        # so that `spmd jobscript ... > job.sh && sbatch job.sh` works.
        req.run_dir.mkdir(parents=True, exist_ok=True)
        sys.stdout.write(render(req))
        return 0
    path = write_script(req)
    print(f"spmd jobscript: wrote {path}", file=sys.stderr)
    if args.chain:
        ids = submit_chain(req.scheduler, path, args.chain)
        for i, job_id in enumerate(ids):
            after = f" (after {ids[i - 1]})" if i else ""
            print(f"spmd jobscript: submitted job {job_id}{after}", file=sys.stderr)
            print(job_id)
    elif args.submit:
        job_id = submit(req.scheduler, path)
        print(f"spmd jobscript: submitted job {job_id}", file=sys.stderr)
        print(job_id)
    return 0
