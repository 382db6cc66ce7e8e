"""distwrap integration tests run under torchrun, at upstream's module path.

Owns ``test_helpers`` (what upstream's ``*Test.py`` files here import) and ``ImportOrderTest``
(ours, in upstream's style).  Upstream's own test files are placed here only for a run
(``benchmarks/diagnostics/run_upstream_tests.py``; ``.gitignore`` lists their names).  Imports
only ``torch``, the standard library and ``torchcomms``.
"""
