"""CRIU on this host: installed, `criu check` passes, what it can do on this kernel."""

from __future__ import annotations

import os
import sys
from typing import Any

from npusnap_cli import criu, paths
from npusnap_cli.errors import PreflightError
from npusnap_cli.host.preflight.items import OK, PROBLEM, WARNING, CheckItem


def check_criu() -> list[CheckItem]:

    items: list[CheckItem] = []
    try:
        binary = criu.find_criu()
    except PreflightError as err:
        return [CheckItem("criu", PROBLEM, err.message, err.fix), CheckItem("criu-check", PROBLEM, "not run")]
    items.append(
        CheckItem(
            "criu",
            OK,
            f"{binary.path} version {binary.version}",
            data={"path": binary.path, "version": binary.version},
        )
    )
    if os.geteuid() != 0:
        items.append(
            CheckItem(
                "criu-check",
                PROBLEM,
                "`criu check` needs root",
                "run `sudo npusnap check` (CRIU dump/restore run as root)",
                data={"passed": None, "output": ""},
            )
        )
    else:
        passed, output = criu.run_criu_check(binary)
        last = output.splitlines()[-1] if output else ""
        items.append(
            CheckItem(
                "criu-check",
                OK if passed else PROBLEM,
                f"`criu check`: {last or ('passed' if passed else 'failed')}",
                "" if passed else f"run `{binary.path} check` and read its output (kernel features missing?)",
                data={"passed": passed, "output": output},
            )
        )
    items.append(inet_sockets_item(binary))
    items.append(network_lock_item())
    items.append(lazy_pages_item(binary))
    pyver = criu.pycriu_version()
    if pyver is None:
        items.append(
            CheckItem(
                "pycriu",
                PROBLEM,
                "pycriu cannot be imported",
                _pycriu_fix(
                    binary.version,
                    "run ./scripts/setup.sh (it installs pycriu from the CRIU source into .venv)",
                ),
                data={"version": None},
            )
        )
    elif pyver != binary.version:
        items.append(
            CheckItem(
                "pycriu",
                PROBLEM,
                f"pycriu {pyver} does not match criu {binary.version}",
                _pycriu_fix(binary.version, "reinstall pycriu from the same CRIU source: ./scripts/setup.sh"),
                data={"version": pyver},
            )
        )
    else:
        items.append(CheckItem("pycriu", OK, f"pycriu {pyver} (matches criu)", data={"version": pyver}))
    return items


def _pycriu_fix(version: str, checkout_fix: str) -> str:
    """pycriu is not on the package index: a checkout's setup builds it; a node install takes the
    wheel built from the same CRIU source (scripts/build_node_wheels.py --pycriu-src)."""
    if paths.is_checkout():
        return checkout_fix
    return (
        f"build pycriu from CRIU {version}'s source (make -C <criu-{version}> lib; pip wheel "
        f"<criu-{version}>/lib) and install it into npusnap's virtualenv: {sys.prefix}/bin/pip install "
        f"pycriu-{version}-py3-none-any.whl"
    )


def inet_sockets_item(binary: Any) -> CheckItem:
    """CRIU before 4.2 fails on every TCP/UDP socket on kernels 6.16+ (a listening one too)."""
    refuses = criu.kernel_refuses_inet_passcred()
    ok = criu.inet_sockets_supported(binary)
    data = {"kernel_refuses_passcred": refuses, "criu": binary.version}
    if ok:
        why = (
            "this kernel refuses SO_PASSCRED on inet sockets, CRIU 4.2+ copes"
            if refuses
            else "no kernel quirk"
        )
        return CheckItem(
            "criu-sockets", OK, f"CRIU {binary.version} can dump TCP/UDP sockets ({why})", data=data
        )
    return CheckItem(
        "criu-sockets",
        PROBLEM,
        f"CRIU {binary.version} cannot dump any TCP/UDP socket on this kernel "
        f"({os.uname().release} refuses SO_PASSCRED on inet sockets)",
        "install CRIU 4.2 or newer: ./scripts/setup.sh builds 4.2.1 (a job with a metrics port, "
        "a torch.distributed store or any UDP socket fails to dump otherwise)",
        data=data,
    )


def lazy_pages_item(binary: Any) -> CheckItem:
    """Can `restore --lazy` work here (userfaultfd with non-cooperative events)? A warning only:
    lazy restore is optional, and `restore --lazy` refuses by itself when it cannot."""
    ok, words = criu.lazy_pages_supported(binary)
    last = words.splitlines()[-1] if words else ""
    if ok:
        return CheckItem("criu-lazy-pages", OK, f"restore --lazy works ({last})", data={"supported": True})
    return CheckItem(
        "criu-lazy-pages",
        WARNING,
        f"restore --lazy is not possible here: {last or 'criu check --feature uffd-noncoop failed'}",
        "needs userfaultfd with non-cooperative events (kernel 4.11+, CONFIG_USERFAULTFD) and root "
        "or vm.unprivileged_userfaultfd=1; plain restore is unaffected",
        data={"supported": False, "output": words},
    )


def network_lock_item() -> CheckItem:
    """Which network lock a dump of established TCP connections will use, and whether it can."""
    import shutil

    method = criu.default_network_lock()
    if method == "nftables" and not criu.has_nftables():
        return CheckItem(
            "network-lock",
            WARNING,
            "neither libnftables nor the iptables binary: --tcp-established dumps cannot lock the network",
            "apt-get install libnftables1 (or iptables)",
            data={"method": None},
        )
    tool = "libnftables, no binary needed" if method == "nftables" else f"binary {shutil.which('iptables')}"
    return CheckItem("network-lock", OK, f"{method} ({tool})", data={"method": method})
