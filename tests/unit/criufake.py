"""CRIU image files for unit tests, encoded by pycriu from the entries CRIU would write (every
field CRIU's .proto requires), so that criuimages.py decodes what a real dump holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

FOWN = {"uid": 0, "euid": 0, "signum": 0, "pid_type": 0, "pid": 0}
SK_OPTS = {
    "so_sndbuf": 1,
    "so_rcvbuf": 1,
    "so_snd_tmo_sec": 0,
    "so_snd_tmo_usec": 0,
    "so_rcv_tmo_sec": 0,
    "so_rcv_tmo_usec": 0,
}


def write(path: Path, magic: str, entries: list[dict[str, Any]]) -> None:
    import pycriu

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pycriu.images.dump({"magic": magic, "entries": entries}, f)


def usk(id: int, name: str, *, type: int = 1, state: int = 10, ino: int = 0, peer: int = 0) -> dict[str, Any]:
    """A files.img entry of a unix socket; ``name`` in pycriu's form (``=00``: a trailing NUL)."""
    sk = {
        "id": id, "ino": ino or 10 + id, "type": type, "state": state, "flags": 2, "uflags": 0, "backlog": 8,
        "peer": peer, "fown": FOWN, "opts": SK_OPTS, "name": name,
    }  # fmt: skip
    return {"type": "UNIXSK", "id": id, "usk": sk}


def isk(
    id: int, family: int, src: list[int], sport: int, dst: list[int], dport: int, *, state: int = 1
) -> dict[str, Any]:
    """A files.img entry of a TCP socket (addresses as CRIU's 32-bit words)."""
    sk = {
        "id": id, "ino": 100 + id, "family": family, "type": 1, "proto": 6, "state": state,
        "src_port": sport, "dst_port": dport, "flags": 2, "backlog": 0, "src_addr": src, "dst_addr": dst,
        "fown": FOWN, "opts": SK_OPTS,
    }  # fmt: skip
    return {"type": "INETSK", "id": id, "isk": sk}


def reg(id: int, name: str, *, pos: int = 0, size: Optional[int] = None) -> dict[str, Any]:
    """A files.img entry of a regular file (``size`` None: not recorded, as for O_APPEND)."""
    r: dict[str, Any] = {"id": id, "flags": 0o2, "pos": pos, "fown": FOWN, "name": name}
    if size is not None:
        r["size"] = size
    return {"type": "REG", "id": id, "reg": r}


def unix_image(criu: Path, names: list[tuple[str, int, int]]) -> None:
    """files.img with one unix socket per (name, type, state)."""
    criu.mkdir()
    write(criu / "files.img", "FILES", [usk(i, n, type=k, state=s) for i, (n, k, s) in enumerate(names, 1)])


def ids(vm_id: int, files_id: int, **more: int) -> dict[str, Any]:
    return {"vm_id": vm_id, "files_id": files_id, "fs_id": 1, "sighand_id": 1, **more}


def fdinfo(id: int, fd: int, type: str) -> dict[str, Any]:
    return {"id": id, "flags": 0, "type": type, "fd": fd}


def mount(mnt_id: int, mountpoint: str, **more: Any) -> dict[str, Any]:
    return {
        "fstype": 1, "mnt_id": mnt_id, "root_dev": 0, "parent_mnt_id": 1, "flags": 0, "root": "/",
        "mountpoint": mountpoint, "source": "none", "options": "", **more,
    }  # fmt: skip


def core(state: int, **tc: int) -> dict[str, Any]:
    """core-PID.img's entry: the task state (compel's: 1 alive, 2 dead/zombie, 3 stopped)."""
    task = {"task_state": state, "exit_code": 0, "personality": 0, "flags": 0, "blk_sigset": 0, "comm": "x"}
    return {"mtype": "X86_64", "tc": {**task, **tc}}
