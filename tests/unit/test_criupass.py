"""`--criu-opt`: the allow-list of CRIU options npusnap passes through, and how they reach CRIU."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from npusnap_cli import criu, criupass
from npusnap_cli.errors import UsageError
from npusnap_cli.host import procfs


@pytest.mark.parametrize(
    ("given", "command", "line"),
    [
        ("ghost-limit=8M", "dump", "ghost-limit=8M"),
        ("--ghost-limit=1048576", "dump", "ghost-limit=1048576"),
        ("no-ghost-fiemap", "dump", "no-ghost-fiemap"),
        ("ghost-fiemap", "dump", "ghost-fiemap"),
        ("manage-cgroups", "dump", "manage-cgroups"),
        ("manage-cgroups=full", "restore", "manage-cgroups=full"),
        ("skip-in-flight", "dump", "skip-in-flight"),
        ("tcp-close", "dump", "tcp-close"),
        ("force-irmap", "dump", "force-irmap"),
        ("irmap-scan-path=/var/lib/x", "dump", "irmap-scan-path=/var/lib/x"),
        ("join-ns=net:/var/run/netns/blue", "restore", "join-ns=net:/var/run/netns/blue"),
        ("join-ns=uts:4242", "restore", "join-ns=uts:4242"),
    ],
)
def test_allowed_options_become_config_lines(given: str, command: str, line: str) -> None:
    assert criupass.parse([given], command) == (line,)


@pytest.mark.parametrize(
    ("given", "command", "needle"),
    [
        ("root=/", "dump", "not an option npusnap passes"),
        ("action-script=/tmp/x.sh", "restore", "not an option npusnap passes"),
        ("libdir=/tmp", "dump", "not an option npusnap passes"),
        ("ghost-limit=8M", "restore", "an option of dump"),
        ("ghost-limit", "dump", "needs a value"),
        ("ghost-limit=lots", "dump", "a size"),
        ("ghost-limit=8M\nexec-cmd", "dump", "a size"),
        ("skip-in-flight=yes", "dump", "takes no value"),
        ("manage-cgroups=everything", "dump", "one of"),
        ("irmap-scan-path=relative", "dump", "an absolute path"),
        ("irmap-scan-path=/a b", "dump", "an absolute path"),
        ("irmap-scan-path=/a\nroot=/", "dump", "an absolute path"),
        ("join-ns=net:/run/netns/x", "dump", "an option of restore"),
        ("join-ns=user:/proc/1/ns/user,0,0", "restore", "net, uts or ipc"),
        ("join-ns=mnt:/proc/1/ns/mnt", "restore", "net, uts or ipc"),
        ("join-ns=net:relative", "restore", "net, uts or ipc"),
        ("join-ns=net:/a\nroot=/", "restore", "net, uts or ipc"),
    ],
)
def test_anything_else_is_refused_with_the_list(given: str, command: str, needle: str) -> None:
    """Options that would change where CRIU reads or writes as root, what it runs, or that smuggle
    a second line into the configuration file, never reach CRIU."""
    with pytest.raises(UsageError, match=needle):
        criupass.parse([given], command)


def test_the_options_reach_criu_as_a_config_file_of_ours(tmp_path: Path) -> None:
    """The file is made fresh in CRIU's work directory and named through our own descriptor."""
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    opts = criu.CriuOptions(passthrough=("ghost-limit=8M", "skip-in-flight"))
    fd = criu.open_work_dir(str(work), ("dump.log", criu.PASSTHROUGH_CONFIG))
    try:
        path = criu._write_passthrough(fd, opts.passthrough)
        assert path == f"/proc/{os.getpid()}/fd/{fd}/{criu.PASSTHROUGH_CONFIG}"
        assert Path(path).read_text() == "ghost-limit=8M\nskip-in-flight\n"
        assert (work / criu.PASSTHROUGH_CONFIG).stat().st_mode & 0o777 == 0o600
    finally:
        os.close(fd)
    assert opts.to_dict()["passthrough"] == ["ghost-limit=8M", "skip-in-flight"]


def test_threads_in_other_cgroups_is_empty_for_a_whole_process() -> None:
    """The dump's cgroups check reads each thread's cgroups; a process moved whole has none apart."""
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert procfs.threads_in_other_cgroups(os.getpid()) == []
    finally:
        stop.set()
        t.join()
