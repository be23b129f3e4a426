"""fp4forge.lab.diagnostics: one-off research probes, run as ``python -m fp4forge.lab.diagnostics.<name>``.

:mod:`.copy_probe`: can the testbed's architecture learn to copy from its context?
:mod:`.offline_suite`: the quality suite run in-process on a local model (no server).
:mod:`.sweep_trained`: trained-testbed recipe variants, each scored by the offline suite.

They are diagnostics, not tests or benchmarks: they print what they measure and assert nothing.
"""
