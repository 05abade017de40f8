"""Env-gated agent start for `npusnap run` (this directory is put first on PYTHONPATH).

Standard library only and Python 3.9+: it runs at start-up of *every* Python interpreter in the
launched tree, whatever its version. Without ``NPUSNAP_AGENT=1`` it costs one environment
lookup. With it, it makes ``npusnap_cli`` importable from ``NPUSNAP_PKG_PARENT`` (the directory
that holds the CLI's own copy of the package) and starts the agent.

Only one module named ``sitecustomize`` is ever imported, so this one then imports the next
``sitecustomize`` on sys.path (the user's or the distribution's) as if we were not here.
"""

import os
import sys


def _log(line: str) -> None:
    """Into the job's agent log (npusnap_cli could not be imported to do it), never into the
    application's stderr unless NPUSNAP_AGENT_STDERR=1 asks for it: a job under `npusnap run`
    prints what it prints without it."""
    path = os.environ.get("NPUSNAP_AGENT_LOG") or ""
    if path.startswith("/"):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, line.encode("utf-8", "replace"))
            finally:
                os.close(fd)
        except OSError:
            pass
    if os.environ.get("NPUSNAP_AGENT_STDERR") == "1":
        try:
            sys.stderr.write(line)
        except Exception:
            pass


def _start_agent() -> None:
    parent = os.environ.get("NPUSNAP_PKG_PARENT")
    added = ""
    if parent and parent not in sys.path:
        # Front of sys.path only while importing, so that our copy of npusnap_cli is used and the
        # rest of the CLI's tree never shadows the application's modules afterwards.
        sys.path.insert(0, parent)
        added = parent
    try:
        import npusnap_cli.agent  # lazy: only with NPUSNAP_AGENT=1, from NPUSNAP_PKG_PARENT

        npusnap_cli.agent.start()
    except Exception as exc:
        _log(f"npusnap-agent: [{os.getpid()}] could not start: {type(exc).__name__}: {exc}\n")
    finally:
        if added:
            try:
                sys.path.remove(added)
            except ValueError:
                pass


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.pop("sitecustomize", None)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        import importlib

        importlib.import_module("sitecustomize")
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
        if ours is not None:
            sys.modules["sitecustomize"] = ours


if os.environ.get("NPUSNAP_AGENT") == "1":
    _start_agent()
_chain()
