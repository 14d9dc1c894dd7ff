"""The test suite: a package, so that its helpers (``tests.support``) and rank-side workers
(``tests.keras.*_worker``) import by name in every process a test starts (the root conftest puts
the checkout on their ``PYTHONPATH``)."""
