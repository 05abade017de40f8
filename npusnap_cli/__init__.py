"""npusnap: snapshot and restore processes that use an Ascend NPU.

This package's top level must stay import-cheap and standard-library only: the agent
(``npusnap_cli.agent``) is imported into target processes, which may run Python 3.9.
"""

__version__ = "0.1.0"
