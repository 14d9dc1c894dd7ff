"""Hostfiles and LaunchPlan without IPython: parsing, validation, commands, exports."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tnt_notebook.cluster.errors import HostfileError, PlanError
from tnt_notebook.cluster.hostfile import (
    is_local_host,
    parse_hostfile_text,
    read_hostfile,
    validate_n_per_node,
)
from tnt_notebook.cluster.launchers import default_mpiexec
from tnt_notebook.cluster.options import plan_from_options
from tnt_notebook.cluster.plan import LaunchPlan
from tnt_notebook.cluster.reports import hydra_deaths, srun_deaths, srun_launch_error
from tnt_notebook.cluster.slurm import SlurmAllocation, SlurmError, expand_counts


def test_hostfile_ignores_comments_and_blank_lines_and_keeps_order():
    text = "# cluster\nnode02\n\n  node01  # second\nnode-3.example.org\n"
    assert parse_hostfile_text(text) == ["node02", "node01", "node-3.example.org"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "is empty"),
        ("# nothing\n   \n", "is empty"),
        ("a\nb\na\n", "line 3: duplicate host 'a' (first on line 1)"),
        ("node1 slots=2\n", "line 1: 'node1 slots=2' is not a host name"),
        ("node1:2\n", "is not a host name"),
        ("-node\n", "is not a host name"),
    ],
)
def test_bad_hostfile_text_is_a_one_line_hostfile_error(text, message):
    with pytest.raises(HostfileError, match=None) as e:
        parse_hostfile_text(text)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)


def test_read_hostfile_reports_missing_directory_and_unreadable(tmp_path):
    with pytest.raises(HostfileError, match="does not exist"):
        read_hostfile(tmp_path / "nope")
    with pytest.raises(HostfileError, match="is a directory"):
        read_hostfile(tmp_path)
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(HostfileError, match="cannot be read"):
        read_hostfile(binary)
    p = tmp_path / "hosts"
    p.write_text("localhost\n")
    assert read_hostfile(p) == ["localhost"]
    if os.geteuid() != 0:  # root reads anything
        p.chmod(0)
        with pytest.raises(HostfileError, match="not readable"):
            read_hostfile(p)


@pytest.mark.parametrize("value", [0, -1, "x", "1.5", True, None, ""])
def test_bad_n_per_node_values(value):
    with pytest.raises(HostfileError, match="--n-per-node must be a positive integer"):
        validate_n_per_node(value)


def test_good_n_per_node_values():
    assert validate_n_per_node(3) == 3 and validate_n_per_node(" 2 ") == 2


def test_local_host_names():
    import socket

    assert is_local_host("localhost") and is_local_host("127.0.0.1")
    assert is_local_host(socket.gethostname())
    assert not is_local_host("surely-not-this-machine.example.org")


def test_plan_for_n_local_ranks_has_loopback_controller_and_engine_mpi_mode():
    plan = LaunchPlan(n=3)
    assert plan.size == 3 and plan.local and plan.listen_address == "127.0.0.1"
    controller, launcher = plan.commands("/p", "cid", list(range(1000, 1009)))
    assert controller[:3] == [sys.executable, "-m", "ipyparallel.controller"]
    assert "--ip=127.0.0.1" in controller and "--IPController.engine_ports=1000" in controller
    assert launcher[:3] == [default_mpiexec(), "-n", "3"]
    i = launcher.index("ipyparallel.engine")
    assert launcher[i - 2 : i + 2] == [sys.executable, "-m", "ipyparallel.engine", "--mpi"]
    assert "-wdir" in launcher and launcher[launcher.index("-wdir") + 1] == os.getcwd()
    assert "--profile-dir=/p" in launcher and "--cluster-id=cid" in launcher


def test_plan_from_hostfile_places_ranks_in_blocks(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost\nnode-b\n")
    plan = LaunchPlan(hostfile=str(hosts), n_per_node=2)
    assert plan.size == 4 and plan.hosts == ["localhost", "node-b"]
    assert [plan.host_of_rank(r) for r in range(4)] == ["localhost"] * 2 + ["node-b"] * 2
    assert not plan.local
    with pytest.raises(PlanError, match="host 'node-b' has no reachable IPv4"):
        plan.listen_address  # noqa: B018
    assert "controller listens on ADDRESS (not found here: host 'node-b'" in plan.describe()
    launcher = plan.launcher_command("/p", "cid", address="10.1.2.3")
    assert launcher[1:7] == ["-n", "4", "-f", "/p/hostfile", "-ppn", "2"]
    # Hydra's proxies connect back to the controller's address; engines make the profile dir
    assert launcher[launcher.index("-localhost") + 1] == "10.1.2.3"
    assert launcher[launcher.index("-launcher-exec") + 1] == "/p/ssh"
    assert "--IPEngine.auto_create=True" in launcher


def test_plan_beyond_loopback_takes_the_controller_address_and_ssh_command(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a\nnode-b\n")
    plan = LaunchPlan(hostfile=str(hosts), controller_ip="127.0.0.1", ssh=sys.executable)
    assert plan.listen_address == "127.0.0.1" and plan.ssh_command == sys.executable
    controller, launcher = plan.commands("/p", "cid", list(range(1000, 1009)))
    assert "--ip=127.0.0.1" in controller
    i = launcher.index("-launcher-exec")
    assert launcher[i - 2 : i + 2] == ["-launcher", "ssh", "-launcher-exec", "/p/ssh"]
    assert plan.ssh_wrapper_text().splitlines()[1:] == [
        "unset IPP_CONNECTION_INFO",
        f'exec {sys.executable} "$@"',
    ]
    with pytest.raises(PlanError, match="--controller-ip '192.0.2.254' is not an IPv4 address"):
        LaunchPlan(hostfile=str(hosts), controller_ip="192.0.2.254")
    with pytest.raises(PlanError, match="--ssh '/no/ssh' is not an executable"):
        LaunchPlan(hostfile=str(hosts), ssh="/no/ssh")


def test_plan_exports_follow_the_contract(monkeypatch, tmp_path):
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)  # the user's own would be inherited
    (tmp_path / "no-gpus").write_text("")
    monkeypatch.setenv("TNT_GPU_INVENTORY", str(tmp_path / "no-gpus"))  # (as on a GPU node too)
    monkeypatch.delenv("UCX_TCP_KEEPIDLE", raising=False)
    plan = LaunchPlan(
        n=1,
        exports={"FOO": "a b", "EMPTY": ""},
        fusion_threshold_kb=64,
        no_gpu=True,
        log_level="info",
        output_on_all_devices=True,
        collective_timeout=12.5,
    )
    assert plan.env_exports() == {
        "TNT_NOTEBOOK_RANK": "1",
        "TNT_COLLECTIVE_TIMEOUT": "12.5",
        "TNT_TRANSPORT": "mpi",
        "TNT_FUSION_THRESHOLD": "65536",
        "TNT_LOG_LEVEL": "INFO",
        "TF_CPP_MIN_LOG_LEVEL": "0",
        "TNT_OUTPUT_ON_ALL_DEVICES": "1",
        "TNT_NO_GPU": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "UCX_TCP_KEEPIDLE": "inf",
        "FOO": "a b",
        "EMPTY": "",
    }
    launcher = plan.launcher_command("/p", "cid")
    assert ["-genv", "FOO", "a b"] == launcher[
        launcher.index("FOO") - 1 : launcher.index("FOO") + 2
    ]
    assert LaunchPlan(n=1).env_exports() == {
        "TNT_NOTEBOOK_RANK": "1",
        "TNT_COLLECTIVE_TIMEOUT": "30",
        "TNT_TRANSPORT": "mpi",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "CUDA_VISIBLE_DEVICES": "",  # no GPUs: every rank on the CPU, no GPU initialised
        "UCX_TCP_KEEPIDLE": "inf",
    }
    # the user's own keepalive reaches the ranks (inherited), and -x wins over both
    monkeypatch.setenv("UCX_TCP_KEEPIDLE", "30s")
    assert "UCX_TCP_KEEPIDLE" not in LaunchPlan(n=1).env_exports()
    x = LaunchPlan(n=1, exports={"UCX_TCP_KEEPIDLE": "5s"}).env_exports()
    assert x["UCX_TCP_KEEPIDLE"] == "5s"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 0}, "-n must be a positive integer"),
        ({"n": 2, "hostfile": "x"}, "not both"),
        ({"n_per_node": 2}, "--n-per-node needs --hostfile or a Slurm allocation"),
        ({"n": 1, "exports": {"A-B": "1"}}, "is not an environment variable name"),
        ({"n": 1, "fusion_threshold_kb": -1}, "--fusion-threshold must be >= 0"),
        ({"n": 1, "timeout": 0}, "--timeout must be > 0"),
        ({"n": 1, "log_level": "loud"}, "--log-level must be one of"),
        ({"n": 1, "python": "/no/python"}, "is not an executable"),
        ({"n": 1, "mpiexec": "/no/mpiexec"}, "not found"),
        ({"n": 1, "transport": "smoke-signals"}, "--transport must be one of mpi, gaspi"),
    ],
)
def test_bad_plans_raise_value_errors_before_anything_starts(kwargs, message):
    with pytest.raises(ValueError, match=None) as e:
        LaunchPlan(**kwargs)
    assert message in str(e.value)
    assert isinstance(e.value, (PlanError, HostfileError))


def test_describe_lists_exports_and_the_exact_commands():
    text = LaunchPlan(n=2, exports={"X": "1"}).describe()
    assert "2 rank(s) on this machine" in text
    assert "X='1'" in text and "-genv X 1" in text
    assert f"{default_mpiexec()} -n 2" in text and "ipyparallel.controller" in text
    assert Path(default_mpiexec()).name == "mpiexec"


# ----------------------------------------------------------------------- inside a Slurm allocation
JOB = SlurmAllocation("7", "node[1-2]", ("node1", "node2"), (2, 2), gpus_per_node=0)


def test_the_allocation_places_ranks_per_node_and_hydra_reaches_the_nodes_through_srun():
    plan = LaunchPlan(slurm=JOB)
    assert plan.size == 4 and plan.hosts == ["node1", "node2"] and plan.n_per_node == 2
    assert [plan.host_of_rank(r) for r in range(4)] == ["node1"] * 2 + ["node2"] * 2
    assert plan.origin == "Slurm job 7 (nodes node[1-2]; mpiexec, whose proxies srun starts)"
    _, launcher = plan.commands("/p", "cid", address="10.1.2.3")
    assert launcher[1:7] == ["-n", "4", "-f", "/p/hostfile", "-ppn", "2"]
    i = launcher.index("-launcher")
    assert launcher[i - 2 : i + 4] == [
        "-localhost",
        "10.1.2.3",
        "-launcher",
        "slurm",
        "-launcher-exec",
        "/p/srun",
    ]
    # a step of its own name beside the notebook's, without Slurm's PMI, nor the engines' keys
    assert plan.srun_wrapper_text("cid").splitlines()[1:] == [
        "unset IPP_CONNECTION_INFO",
        'exec srun --job-name=tnt-cid --overlap --mpi=none "$@"',
    ]
    assert LaunchPlan(slurm=JOB, n_per_node=1).size == 2


def test_srun_launches_one_rank_per_task_with_pmi2_and_the_exports_through_env():
    plan = LaunchPlan(slurm=JOB, launcher="srun", n_per_node=3, exports={"A": "x,y"})
    cmd = plan.launcher_command("/p", "cid", address="10.1.2.3")
    assert cmd[: cmd.index("env")] == [
        "srun",
        "--job-name=tnt-cid",
        "--overlap",
        "--kill-on-bad-exit=1",
        "--mpi=pmi2",
        "--nodes=2",
        "--ntasks=6",
        "--ntasks-per-node=3",
        "--distribution=block",
        "--nodelist=node1,node2",
        f"--chdir={plan.cwd}",
        "--input=none",
        "--overcommit",  # more ranks per node than the job's tasks: asked for
    ]
    assert "A=x,y" in cmd and "TNT_NOTEBOOK_RANK=1" in cmd
    assert cmd[cmd.index("-m") + 1] == "ipyparallel.engine"
    assert "--overcommit" not in LaunchPlan(slurm=JOB, launcher="srun").launcher_command("/p", "c")
    assert "srun, one rank per task" in plan.origin


def test_n_and_hostfile_win_over_the_allocation(tmp_path):
    assert LaunchPlan(n=2, slurm=JOB).slurm is None
    inside, outside = tmp_path / "inside", tmp_path / "outside"
    inside.write_text("node2\n")
    outside.write_text("node2\nnode9\n")
    plan = LaunchPlan(hostfile=str(inside), slurm=JOB, controller_ip="127.0.0.1")
    assert plan.slurm is JOB and plan.hosts == ["node2"] and plan.size == 1
    assert "slurm" in plan.launcher_command("/p", "cid")
    plan = LaunchPlan(hostfile=str(outside), slurm=JOB, controller_ip="127.0.0.1")
    assert plan.slurm is None
    assert "ssh" in plan.launcher_command("/p", "cid")


def test_slurm_mistakes_are_one_line_errors(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)
    with pytest.raises(PlanError, match="--launcher srun starts the ranks as a Slurm job step"):
        LaunchPlan(launcher="srun")
    with pytest.raises(PlanError, match="--launcher must be one of mpiexec, srun"):
        LaunchPlan(n=1, launcher="ssh")
    uneven = SlurmAllocation("8", "n[1-2]", ("n1", "n2"), (2, 1), gpus_per_node=0)
    with pytest.raises(SlurmError, match=r"job 8 grants different task counts per node \(n1: 2"):
        LaunchPlan(slurm=uneven)
    assert LaunchPlan(slurm=uneven, n_per_node=1).size == 2
    with pytest.raises(SlurmError, match="cannot read Slurm's per-node count"):
        expand_counts("2(x")
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]


def test_srun_names_the_task_that_ended_the_step_first():
    report = (
        "srun: error: n2: task 3: Killed\n"
        "srun: launch/slurm: _step_signal: Terminating StepId=15.0\n"
        "srun: error: n1: tasks 0-1: Terminated\n"
        "srun: error: n2: task 2: Exited with exit code 7\n"
    )
    deaths = srun_deaths(report)
    assert [(d.rank, d.host, d.how()) for d in deaths] == [
        (3, "n2", "killed by signal SIGKILL"),
        (0, "n1", "killed by signal SIGTERM"),
        (1, "n1", "killed by signal SIGTERM"),
        (2, "n2", "exit code 7"),
    ]


def test_hydra_reports_only_processes_ended_by_a_signal_whose_exit_code_is_the_signal():
    """Hydra prints BAD TERMINATION for a process whose wait status is not WIFEXITED, the raw
    status as its EXIT CODE (with 128 where a core was dumped); over ssh, without the EXIT STRING
    line that a local run adds."""
    block = (
        "=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n"
        "=   PID {pid} RUNNING AT {host}\n=   EXIT CODE: {code}\n"
        "=   CLEANING UP REMAINING PROCESSES\n"
    )
    report = block.format(pid=129, host="n2", code=9) + block.format(pid=77, host="n1", code=139)
    deaths = hydra_deaths(report)
    assert [(d.pid, d.host, d.how()) for d in deaths] == [
        (129, "n2", "killed by signal SIGKILL"),
        (77, "n1", "killed by signal SIGSEGV"),
    ]


def test_slurm_failing_to_start_the_ranks_is_told_apart_from_a_rank_ending():
    assert srun_launch_error("srun: error: n2: task 3: Killed\n") is None
    assert srun_launch_error(
        "srun: error: n2: task 3: Killed\nsrun: error: Invalid MPI type 'pmix', --mpi=list\n"
    ) == ("Invalid MPI type 'pmix', --mpi=list")
    pmi = "slurmstepd-n1: error: mpi/pmi2: value not properly terminated in client request\n"
    assert srun_launch_error(pmi).startswith(
        "Slurm's PMI server failed (mpi/pmi2: value not properly terminated in client request)"
    )
    assert srun_launch_error(pmi).endswith("use --launcher mpiexec")


def test_the_cleanup_recognizes_every_rank_command_the_plan_starts():
    """What `%tnt_cluster cleanup` and `tnt-run --cleanup` end is found by its command line: a
    notebook's rank and a tnt-run rank (pinned to a socket or not), never another process."""
    from tnt_notebook.cluster.cleanup import cluster_id_of

    plan = LaunchPlan(n=2)
    assert cluster_id_of(plan.notebook_rank_command("/p", "nb1")) == "nb1"
    assert cluster_id_of(plan.script_command(["train.py"], "/p", "run1")) == "run1"
    pinned = LaunchPlan(n=2, pin_to_socket=False)
    pinned.pin_to_socket = True  # (numactl need not be installed to build the command)
    assert cluster_id_of(pinned.script_command(["train.py"], "/p", "run2")) == "run2"
    assert cluster_id_of(["python", "train.py", "--cluster-id=x"]) is None


def test_reproducible_sets_tnt_reproducible_on_every_rank():
    options = type("Options", (), {"reproducible": True, "n": 2})()
    assert plan_from_options(options).env_exports()["TNT_REPRODUCIBLE"] == "1"
    assert "TNT_REPRODUCIBLE" not in LaunchPlan(n=2).env_exports()
