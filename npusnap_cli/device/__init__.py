"""The device side: the agent inside each target, reached from the CLI.

Its wire protocol (``protocol``: standard library only, Python 3.9+), the control-socket client
(``agent_client``), several agents driven in parallel (``devicegroup``) and the ways the agent is
put into a running process (``attach``, ``native_attach``).

Empty on purpose (a docstring only): ``protocol`` must stay importable, cheaply and with the
standard library alone, on Python 3.9.
"""
