"""The host side: processes and /proc, host resources a CRIU image does not carry, preflight, cleanup.

Empty on purpose (a docstring only): importing a module of this package must cost no more than
that module. ``procfs`` is imported by the simulator's manager and the benchmark.
"""
