"""Where running a cell reaches inside ipyparallel (8.x), each reach in one function: the message
future of each target of an ``AsyncResult`` (what its own ``stream_output`` iterates), and the
client's IO loop (where its iopub callbacks run). An ipyparallel that changed either fails here
with one line that says so, not somewhere in a cell."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class IpyparallelChanged(RuntimeError):
    """This ipyparallel no longer has what running a cell relies on."""


def message_futures(result: Any, targets: list[int]) -> dict[int, Any]:
    """The message future of each of ``targets`` (in target order) of a view's ``AsyncResult``."""
    futures = getattr(result, "_children", None)
    if futures is None or len(futures) != len(targets):
        raise IpyparallelChanged(_changed("an AsyncResult's futures per target (_children)"))
    return dict(zip(targets, futures, strict=True))


def call_on_io_thread(client: Any, fn: Callable[[], None]) -> None:
    """Run ``fn`` soon in the client's IO thread, where its iopub messages are handled."""
    loop = getattr(client, "_io_loop", None)
    if loop is None:
        raise IpyparallelChanged(_changed("the client's IO loop (_io_loop)"))
    loop.add_callback(fn)


def _changed(what: str) -> str:
    import ipyparallel

    return f"ipyparallel {ipyparallel.__version__} has no {what}; tnt_notebook needs ipyparallel 8"
