"""Runs in a rank: the rank API over the native engine, the entry points the launchers start,
the progress publisher, and the hooks installed in a rank's ipyparallel kernel."""
