"""Where tnt_notebook reaches inside ipyparallel (8.x, 9.x), each reach in one function: the
message future of each target of an ``AsyncResult`` (what its own ``stream_output`` iterates), the
client's IO loop (where its iopub callbacks run), its control requests to engines (what its own
signals and aborts use) and its handler of the hub's notice that an engine is gone. An
ipyparallel that changed fails here with one line that says so, not somewhere in a cell."""

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


def send_control_request(client: Any, targets: list[int], msg_type: str, content: dict) -> Any:
    """Send a control message to each of ``targets`` (answered on the engine's control thread,
    even while it runs a cell); a future of the replies."""
    send = getattr(client, "_send_control_request", None)
    if send is None:
        raise IpyparallelChanged(_changed("control requests to engines (_send_control_request)"))
    return send(targets, msg_type, content, block=False)


def on_engine_lost(client: Any, record: Callable[[int], None]) -> bool:
    """Call ``record(engine_id)`` as soon as the hub tells the client that an engine is gone,
    before the client's own handling of it; False where this ipyparallel has no such handler."""
    handlers = getattr(client, "_notification_handlers", None)
    own = None if handlers is None else handlers.get("unregistration_notification")
    if own is None:
        return False

    def recorded(msg: dict[str, Any]) -> None:
        record(int(msg["content"]["id"]))
        own(msg)

    handlers["unregistration_notification"] = recorded
    return True


def _changed(what: str) -> str:
    import ipyparallel

    return f"ipyparallel {ipyparallel.__version__} has no {what}; tnt_notebook needs ipyparallel 8"
