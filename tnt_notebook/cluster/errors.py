"""The one-line errors of a launch's inputs: a hostfile and the launch options. The magics turn them
into an IPython ``UsageError``, ``tnt-run`` into its usage message."""


class HostfileError(ValueError):
    """A hostfile or per-node count that cannot be launched; the message is one line."""


class PlanError(ValueError):
    """Options that do not make a launchable cluster (one-line message)."""
