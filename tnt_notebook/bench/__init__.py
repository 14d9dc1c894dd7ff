"""Benchmarks: ``python -m tnt_notebook.bench <name>`` runs ``tnt_notebook.bench.<name>.main``."""
