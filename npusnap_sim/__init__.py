"""The simulated Ascend NPU (npusim): device daemon, its wire format, its manager and the
`npusnap sim` command (cli.py).

A stand-in for hardware, beside the product: it imports npusnap_cli, which never imports it (the
CLI's command table names ``npusnap_sim.cli`` by its full name). Standard library only, but for
cli.py. See docs/simulator.md and docs/internals.md.
"""
