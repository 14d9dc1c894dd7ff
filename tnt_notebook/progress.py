"""Training progress: the master rank publishes, the notebook renders one live display.

INTERIM placeholder with the final signatures (issue 5 implements it).
"""

from __future__ import annotations

from typing import Any

PROGRESS_MIME = "application/vnd.tnt-notebook.progress+json"


def progress_callback(mode: str, verbose: int, **params: Any) -> Any:
    """Return the Keras callback that shows progress on this rank, or None for Keras's own progbar."""
    return None


def handle_display(
    data: dict, metadata: dict, display_id: str | None, update: bool
) -> bool:
    """Render a rank's display message as the notebook's progress view; False if it is not ours."""
    return False


def end_of_cell(error: str | None) -> None:
    """Called by remote.py when a %%tnt cell ends; unfinished views turn failed when error is set."""
