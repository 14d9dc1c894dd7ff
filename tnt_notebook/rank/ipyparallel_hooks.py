"""What the notebook installs in each rank (an ipyparallel engine process): the readiness check
that says who the rank is, the guard that lets SIGINT interrupt only a cell's own code, the
answer to the notebook's stack requests (rank/stack_report.py), and the start of the native
engine where its transport must start up front.

Runs on the ranks; imported there by reference when :func:`rank_info` is applied.
"""

from __future__ import annotations

from typing import Any

_SIGINT_STATE = {"pending": False}


def _deferred_sigint(signum: int, frame: Any) -> None:
    _SIGINT_STATE["pending"] = True


def _enter_cell() -> None:
    """Injected as the first statement of every cell on a rank: from here on SIGINT raises; one
    that arrived while the rank was getting ready raises now."""
    import signal as _signal

    from tnt_notebook.rank.stack_report import set_cell_running

    set_cell_running(True)
    _signal.signal(_signal.SIGINT, _signal.default_int_handler)
    if _SIGINT_STATE["pending"]:
        _SIGINT_STATE["pending"] = False
        raise KeyboardInterrupt("interrupted before the cell's code started")


def guard_cell_interrupts() -> None:
    """On a rank: let SIGINT raise KeyboardInterrupt only while a cell's own code runs.

    ipykernel turns SIGINT into KeyboardInterrupt for the whole message handler; one arriving
    before or after the user's code aborts the handler without a reply and wedges the rank's kernel.
    Here the handler defers SIGINT outside the code, and the cell's first (injected) statement
    switches to raising, delivering a deferred one at once. The client signals only ranks that
    have announced the cell (execute_input), so a deferred SIGINT always belongs to this cell.
    """
    import ast
    import signal as _signal

    from IPython import get_ipython

    from tnt_notebook.rank.stack_report import set_cell_running

    ip = get_ipython()
    kernel = getattr(ip, "kernel", None)
    if ip is None or kernel is None or getattr(kernel, "_tnt_guarded", False):
        return

    def pre_handler_hook() -> None:
        _SIGINT_STATE["pending"] = False
        kernel.saved_sigint_handler = _signal.signal(_signal.SIGINT, _deferred_sigint)

    def post_run_cell(*_: Any) -> None:
        set_cell_running(False)
        _signal.signal(_signal.SIGINT, _deferred_sigint)

    class EnterCell(ast.NodeTransformer):
        def visit_Module(self, node: ast.Module) -> ast.Module:
            call = ast.parse(
                "__import__('tnt_notebook.rank.ipyparallel_hooks')"
                ".rank.ipyparallel_hooks._enter_cell()"
            )
            node.body.insert(0, call.body[0])
            return node

    kernel.pre_handler_hook = pre_handler_hook
    ip.events.register("post_run_cell", post_run_cell)
    ip.ast_transformers.append(EnterCell())
    kernel._tnt_guarded = True


def after_failed_cell() -> None:
    """Applied on every rank once a cell failed on some: each drops its native engine
    (:func:`tnt_notebook.rank.api.reset_engine`), so the next cell's collectives work everywhere."""
    import sys

    ranks = sys.modules.get("tnt_notebook.rank.api")
    if ranks is not None:  # (else this rank has no native engine)
        ranks.reset_engine()


def rank_info() -> dict[str, Any]:
    """Runs on every rank at start-up: who am I in the MPI world, and which GPU is mine
    (``visible``: the ``CUDA_VISIBLE_DEVICES`` the rank keeps)."""
    import os
    import socket
    import sys

    from mpi4py import MPI  # already initialised by `ipyparallel.engine --mpi`

    from tnt_notebook.rank import device, tf_logs
    from tnt_notebook.rank.stack_report import answer_stack_requests

    visible = device.keep_own_gpu()  # before any cell can import TensorFlow
    # the rank has connected: its keys need not reach the processes that user code starts
    os.environ.pop("IPP_CONNECTION_INFO", None)
    guard_cell_interrupts()
    answer_stack_requests()
    tf_logs.quiet_import()
    comm = MPI.COMM_WORLD
    profile = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--profile-dir=")]
    if profile:
        from tnt_notebook.cluster.cleanup import watch_this_host

        watch_this_host(comm, profile[0])
    return {
        "rank": comm.Get_rank(),
        "size": comm.Get_size(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "visible": visible,
    }


def start_native_engine() -> str | None:
    """Runs on every rank of a cluster whose transport starts up front (GASPI: GPI-2 starts once
    per process, so a failure such as a port in use must stop the cluster's start, not a later
    cell): builds the native engine; returns the error, if any."""
    from tnt_notebook.rank import api as ranks

    try:
        ranks.engine_info()
    except Exception as e:  # noqa: BLE001 - reported by the cluster's start
        return f"{type(e).__name__}: {e}"
    return None
