"""Hostfiles and LaunchPlan without IPython: parsing, validation, commands, exports."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tnt_notebook.launch import (
    HostfileError,
    LaunchPlan,
    PlanError,
    default_mpiexec,
    is_local_host,
    parse_hostfile_text,
    read_hostfile,
    validate_n_per_node,
)


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


def test_plan_exports_follow_the_contract(monkeypatch):
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)  # the user's own would be inherited
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
        "TNT_NOTEBOOK_ENGINE": "1",
        "TNT_COLLECTIVE_TIMEOUT": "12.5",
        "TNT_TRANSPORT": "mpi",
        "TNT_FUSION_THRESHOLD": "65536",
        "TNT_LOG_LEVEL": "INFO",
        "TF_CPP_MIN_LOG_LEVEL": "0",
        "TNT_OUTPUT_ON_ALL_DEVICES": "1",
        "TNT_NO_GPU": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "FOO": "a b",
        "EMPTY": "",
    }
    launcher = plan.launcher_command("/p", "cid")
    assert ["-genv", "FOO", "a b"] == launcher[
        launcher.index("FOO") - 1 : launcher.index("FOO") + 2
    ]
    assert LaunchPlan(n=1).env_exports() == {
        "TNT_NOTEBOOK_ENGINE": "1",
        "TNT_COLLECTIVE_TIMEOUT": "30",
        "TNT_TRANSPORT": "mpi",
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }


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
