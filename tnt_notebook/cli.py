"""``tnt-run``: run a training script on the ranks of a launch plan, from a shell.

Tarantella's launcher (``tarantella --hostfile hosts --n-per-node 2 -- train.py``) on the same
:class:`~tnt_notebook.cluster.plan.LaunchPlan` as ``%tnt_cluster``: the same options, hostfile
checks, exports and mpiexec command, with the script's ranks
(:mod:`tnt_notebook.rank.run_script`) in place of the notebook's. The master rank's output is
shown (every rank's with ``--output-on-all-devices``); the exit status is the first failing rank's,
named; Ctrl-C ends every rank on every host.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

from tnt_notebook import settings
from tnt_notebook.cluster.cleanup import OWNER_FILE, PROFILE_PREFIX
from tnt_notebook.cluster.errors import HostfileError
from tnt_notebook.cluster.launchers import write_private
from tnt_notebook.cluster.options import LAUNCH_OPTIONS, plan_from_options
from tnt_notebook.cluster.plan import LaunchPlan
from tnt_notebook.cluster.processes import die_with_parent, killpg, wait_until
from tnt_notebook.cluster.reports import hydra_deaths, srun_deaths, srun_launch_error
from tnt_notebook.rank.run_script import RANK_STATUS

_PYTHON_RE = re.compile(r"^python[0-9.]*$")
_STATUS_RE = re.compile(rf"^{RANK_STATUS} rank=(\d+) pid=(\d+) host=(\S+) (\S+)$")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="tnt-run",
        description="Run a Python training script on every rank: -n N ranks on this machine, "
        "--n-per-node K ranks on each host of a hostfile (reached with ssh), or, inside a Slurm "
        "allocation (salloc, sbatch) with neither, on each node of the allocation.",
        epilog="example: tnt-run --hostfile hosts --n-per-node 2 -- train.py --epochs 3 "
        "(or -- python train.py ...). Ranks per node default to the GPUs of each node, one GPU "
        "per rank; without GPUs, one rank per node on the CPU.",
    )
    for flags, kwargs in LAUNCH_OPTIONS:
        ap.add_argument(*flags, **kwargs)
    ap.add_argument(
        "--cleanup", action="store_true", help="end this user's leftover ranks on the hosts"
    )
    ap.add_argument(
        "--timeline",
        metavar="DIR",
        default=None,
        help="record the timeline of sampled train steps of each fit; the master rank writes "
        "its summary, Chrome trace and plot into DIR (sets TNT_TIMELINE)",
    )
    ap.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT.py [ARGS...]")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    try:
        if not script and not args.cleanup:
            raise ValueError("no script given: tnt-run [options] -- SCRIPT.py [ARGS...]")
        script = _without_interpreter(script, args)
        if script and not os.path.isfile(script[0]):
            raise ValueError(f"script {script[0]!r} does not exist")
        if args.timeline is not None:
            directory = os.path.abspath(args.timeline)
            args.exports = [*(args.exports or []), f"{settings.TIMELINE.name}={directory}"]
        plan = plan_from_options(args)
        plan.listen_address  # noqa: B018 - hosts that cannot be reached fail here, in one line
    except (HostfileError, ValueError) as e:
        print(f"tnt-run: error: {e}", file=sys.stderr)
        return 2
    if plan.devices.warning and not args.dry_run:  # (the plan shows it)
        print(f"tnt-run: warning: {plan.devices.warning}", file=sys.stderr)
    if args.cleanup:
        from tnt_notebook.cluster.cleanup import end_leftover_ranks_on_hosts

        print("\n".join(end_leftover_ranks_on_hosts(plan)))
        return 0
    if args.dry_run:
        print(plan.describe(script))
        return 0
    return run(plan, script)


def _without_interpreter(script: list[str], args: argparse.Namespace) -> list[str]:
    """``-- python train.py ARGS`` as mpirun's, horovodrun's and torchrun's users write it: the
    script and its arguments, run by that interpreter (unless --python-interpreter names one)."""
    if not script or not _PYTHON_RE.match(os.path.basename(script[0])):
        return script
    if len(script) < 2 or script[1].startswith("-"):
        raise ValueError(
            f"{shlex.join(script[:2])}: give the script right after the interpreter "
            "(tnt-run -- python SCRIPT.py ARGS...); interpreter options are not passed on"
        )
    interpreter = shutil.which(script[0])
    if interpreter is None:
        raise ValueError(f"interpreter {script[0]!r} not found")
    if args.python_interpreter is None:
        args.python_interpreter = interpreter
    return script[1:]


def run(plan: LaunchPlan, script: list[str]) -> int:
    """Run `script` on the plan's ranks until they end; the first failing rank's exit status."""
    workdir = tempfile.mkdtemp(prefix=PROFILE_PREFIX)
    write_private(os.path.join(workdir, OWNER_FILE), f"{os.getpid()}")
    cluster_id = uuid.uuid4().hex[:12]
    try:
        plan.write_launch_files(workdir, cluster_id)
        cmd = plan.launcher_command(
            workdir, cluster_id, program=plan.script_command(script, workdir, cluster_id)
        )
        srun = plan.launcher == "srun"
        env = plan.launch.environment(os.environ)
        return _supervise(cmd, plan.cwd, env, srun=srun, srun_step=plan.slurm is not None)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _supervise(
    cmd: list[str], cwd: str, env: dict[str, str], srun: bool = False, srun_step: bool = False
) -> int:
    """Run the launcher (in `env`) until it ends; `srun`: it is srun itself, `srun_step`: the
    ranks are a Slurm job step (srun's own errors are then watched for)."""
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env=env,
        start_new_session=True,  # Ctrl-C reaches it through us, escalated with a deadline
        preexec_fn=die_with_parent,
    )
    ranks: dict[tuple[str, int], int] = {}  # (host, pid) -> rank
    failures: list[tuple[int, str, int]] = []  # (rank, host, code) in the order they came
    report: list[str] = []  # mpiexec's own messages land on either stream
    launch_errors: list[str] = []  # srun could not start the ranks (Hydra would wait forever)

    def read_stdout() -> None:
        for raw in proc.stdout:
            line = raw.decode(errors="replace")
            if line.startswith(("=", "YOUR APPLICATION TERMINATED")):  # Hydra's report
                report.append(line)
            sys.stdout.write(line)
            sys.stdout.flush()

    def read_stderr() -> None:
        for raw in proc.stderr:
            line = raw.decode(errors="replace")
            m = _STATUS_RE.match(line.rstrip("\n"))
            if m is None:
                error = srun_launch_error(line) if srun_step and not ranks else None
                if error:
                    launch_errors.append(error)
                report.append(line)
                sys.stderr.write(line)
                sys.stderr.flush()
            elif m[4] == "started":
                ranks[(m[3], int(m[2]))] = int(m[1])
            else:
                failures.append((int(m[1]), m[3], int(m[4].split("=", 1)[1])))

    readers = [threading.Thread(target=f, daemon=True) for f in (read_stdout, read_stderr)]
    for t in readers:
        t.start()
    interrupted = []
    previous = {
        sig: signal.signal(sig, lambda s, f: interrupted.append(s))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        while proc.poll() is None and not interrupted and not launch_errors:
            try:
                proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass
        if interrupted or launch_errors:
            _end(proc, srun)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for t in readers:
        t.join(5)
    if interrupted:
        print("tnt-run: interrupted; every rank was ended", file=sys.stderr)
        return 130
    if launch_errors:
        print(f"tnt-run: Slurm could not start the ranks: {launch_errors[0]}", file=sys.stderr)
        return 1
    if failures:
        rank, host, code = failures[0]
        print(f"tnt-run: rank {rank} on {host} failed first (exit code {code})", file=sys.stderr)
        return code
    deaths = hydra_deaths("".join(report)) + srun_deaths("".join(report))
    if deaths and proc.returncode:  # a rank that could not say why: killed, most likely
        d = deaths[0]
        rank = d.rank if d.rank is not None else ranks.get((d.host, d.pid or 0))
        who = f"rank {rank} on {d.host}" if rank is not None else f"pid {d.pid} on {d.host}"
        print(f"tnt-run: {who} died first ({d.how()})", file=sys.stderr)
        return 128 + d.signal if d.signal is not None else d.code or proc.returncode
    return proc.returncode


def _end(proc: subprocess.Popen, srun: bool = False) -> None:
    """Ctrl-C: mpiexec forwards SIGINT to every rank (srun does on a second SIGINT within a
    second); then SIGTERM and SIGKILL with deadlines (the launcher's end takes the ranks on
    other hosts with it)."""
    for sig, grace in ((signal.SIGINT, 5.0), (signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        killpg(proc.pid, sig)
        if srun and sig == signal.SIGINT:
            time.sleep(0.2)
            killpg(proc.pid, sig)
        wait_until(proc, time.monotonic() + grace)
        if proc.poll() is not None:
            return


if __name__ == "__main__":
    sys.exit(main())
