"""When an image may be trusted: what it may contain, who may own it, what its manifest may say.

An image is run as root by ``npusnap restore``: CRIU recreates the processes from it with their
memory and files, and restore creates the agent socket directories it names. So everything in an
image is checked before any of it is used (docs/image-format.md, "Trust model"):

* ``check_tree``: only real directories and regular files, anywhere (no symlink: a page file
  pointing at /etc/shadow, a ``criu/`` pointing at another image; no FIFO that would hang a
  reader; no device node);
* ``check_ownership``: like ssh's StrictModes, every entry is owned by the user who restores
  (or root) and writable by nobody else; otherwise another user could swap files between
  ``verify`` and CRIU's reads;
* ``check_manifest``: the manifest against itself and against the files (paths relative and
  under ``criu/``, nothing under ``logs/``, pids and devices in range, the npu flag consistent
  with the device data, agent sockets only where agents put them);
* ``check_json_depth``: a bounded nesting depth, so that a crafted manifest is an ImageError and
  not a RecursionError;
* signatures: ``dump --sign KEY`` writes ``npusnap.json.sig``, an Ed25519 signature of the
  manifest's bytes (which carry every file's checksum); ``--require-signature PUBKEY`` refuses an
  image without a valid one. The manifest also carries its own sha256 (``manifest_sha256``), so
  an edit of any field is reported even without a signature (a signature also stops an editor
  who recomputes that hash).
"""

from __future__ import annotations

import base64
import os
import re
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from npusnap_cli import contract, paths
from npusnap_cli.errors import ImageError, UsageError
from npusnap_cli.image.layout import CHECKSUMMED_SUBDIRS, kind_of

if TYPE_CHECKING:
    # manifest.py uses this module to read a manifest; the type is all this one needs of it.
    from npusnap_cli.image.manifest import Manifest

SIGNATURE_NAME = "npusnap.json.sig"
MAX_JSON_DEPTH = 16
MAX_MANIFEST_BYTES = 16 << 20
PID_MAX = 1 << 22  # the kernel's highest pid_max (PID_MAX_LIMIT on 64-bit)
MAX_DEVICE_ID = 1023
_DIGEST = re.compile(r"[0-9a-f]{64}")  # blake3 and sha256 alike (digest.py)
TOKEN_RE = re.compile(r"[0-9a-f]{32}")

_TAMPERED = "the manifest was written by another tool or edited after the dump"
_DO_NOT_USE = "do not use this image; dump again (or copy it again from its source)"


# --------------------------------------------------------------------------------------------
# The files
# --------------------------------------------------------------------------------------------


def _walk(image: Path) -> list[tuple[str, os.stat_result]]:
    """(relative path, lstat) of the image and of everything in it, without following symlinks."""
    out: list[tuple[str, os.stat_result]] = [(".", os.lstat(image))]
    if not stat.S_ISDIR(out[0][1].st_mode):
        return out
    for root, dirs, files, root_fd in os.fwalk(image, follow_symlinks=False):
        rel_root = os.path.relpath(root, image)
        for name in dirs + files:
            rel = name if rel_root == "." else f"{rel_root}/{name}"
            out.append((rel, os.stat(name, dir_fd=root_fd, follow_symlinks=False)))
    return out


def check_tree(image: Path) -> None:
    """Refuse an image that holds anything but real directories and regular files."""
    try:
        entries = _walk(image)
    except OSError as exc:
        raise ImageError(f"cannot read the image {image}: {exc.strerror or exc}") from None
    bad = [
        f"{image if rel == '.' else image / rel} is {kind_of(st.st_mode)}"
        for rel, st in entries
        if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode))
    ]
    if bad:
        raise ImageError(
            f"refusing the image {image}: {bad[0]}",
            why="an image holds only directories and regular files; a symlink or special file in it "
            "would make restore read or write something outside the image",
            fix=f"{_DO_NOT_USE}; to restore from a symlinked path pass its real path (realpath {image})",
            details={"problems": bad},
        )


def check_ownership(image: Path, uid: Optional[int] = None) -> None:
    """StrictModes: every entry owned by ``uid`` (default: this user) or root, writable by nobody else."""
    uid = os.geteuid() if uid is None else uid
    try:
        entries = _walk(image)
    except OSError as exc:
        raise ImageError(f"cannot read the image {image}: {exc.strerror or exc}") from None
    problems: list[str] = []
    for rel, st in entries:
        path = image if rel == "." else image / rel
        if st.st_uid not in (uid, 0):
            problems.append(f"{path} is owned by uid {st.st_uid}")
        elif stat.S_IMODE(st.st_mode) & 0o022:
            problems.append(f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o})")
    if problems:
        who = "root" if uid == 0 else f"uid {uid}"
        raise ImageError(
            f"refusing the image {image}: {problems[0]}",
            why=f"an image is restored with {who}'s rights; one that another user can write to could be "
            "changed between its verification and its use (the checks ssh's StrictModes makes)",
            fix=f"if you trust its content: chown -R {uid}:{os.getegid()} {image} && chmod -R go-w {image}",
            details={"problems": problems},
        )


# --------------------------------------------------------------------------------------------
# The manifest
# --------------------------------------------------------------------------------------------


def check_json_depth(text: str) -> None:
    """Refuse JSON nested deeper than MAX_JSON_DEPTH before it reaches the (recursive) parser."""
    stripped = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    depth = 0
    for m in re.finditer(r"[\[\]{}]", stripped):
        depth += 1 if m.group() in "[{" else -1
        if depth > MAX_JSON_DEPTH:
            raise ImageError(
                f"the manifest is nested deeper than {MAX_JSON_DEPTH} levels",
                why=_TAMPERED,
                fix=_DO_NOT_USE,
            )


def _bad(message: str) -> ImageError:
    return ImageError(f"manifest: {message}", why=_TAMPERED, fix=_DO_NOT_USE)


def socket_dirs(uid: int) -> list[str]:
    """The directories an agent of ``uid`` may listen in (see paths.agent_runtime_dir)."""
    if uid == 0:
        dirs = [contract.AGENT_SOCKET_ROOT_DIR]
    else:
        xdg = f"/run/user/{uid}/{contract.AGENT_SOCKET_XDG_SUBDIR}"
        dirs = [contract.AGENT_SOCKET_TMP_DIR.format(uid=uid), xdg]
    dirs.append(str(paths.agent_runtime_dir(uid if uid >= 0 else None)))
    env = os.environ.get(contract.AGENT_SOCKET_ENV_DIR)
    if env:
        dirs.append(os.path.normpath(env))
    return dirs


def check_manifest(manifest: Manifest) -> None:
    """The manifest against itself: paths, ranges, uniqueness, the npu flag, agent sockets."""
    if not manifest.processes:
        raise _bad("it lists no processes")
    pids = [p.pid for p in manifest.processes]
    if len(set(pids)) != len(pids):
        raise _bad("a pid is listed twice")
    if manifest.root_pid not in pids:
        raise _bad(f"root_pid {manifest.root_pid} is not one of its processes")
    for p in manifest.processes:
        where = f"process {p.pid}"
        if not 1 <= p.pid < PID_MAX or not 0 <= p.ppid < PID_MAX:
            raise _bad(f"{where}: pid or ppid out of range")
        if not -1 <= p.uid < 1 << 32:
            raise _bad(f"{where}: uid {p.uid} out of range")
        if any(not 0 <= d <= MAX_DEVICE_ID for d in p.devices) or p.device_bytes < 0:
            raise _bad(f"{where}: device ids or device_bytes out of range")
        if (p.devices or p.device_bytes) and not p.npu:
            raise _bad(
                f"{where} has device state ({len(p.devices)} device(s), {p.device_bytes} bytes) "
                "but npu is false: restore would leave it locked"
            )
        if p.npu and not (p.agent and p.agent_socket):
            raise _bad(f"{where}: npu is true but it has no agent socket")
        if p.lock_token is not None and not TOKEN_RE.fullmatch(p.lock_token):
            raise _bad(f"{where}: lock_token is not 32 hex digits")
        if p.zombie and (p.agent or p.npu or p.agent_socket):
            raise _bad(f"{where} is a zombie but has an agent or device state")
        if p.agent_socket is not None:
            sock = p.agent_socket
            allowed = socket_dirs(p.uid)
            name = os.path.basename(sock)
            # A restored copy of a job in its own pid namespace listens under a name of its own.
            copy = str(p.pid) in manifest.pid_ns and paths.COPY_SOCKET_NAME.fullmatch(name) is not None
            if (
                not sock.startswith("/")
                or os.path.normpath(sock) != sock
                or not (name == f"{p.pid}.sock" or copy)
                or os.path.dirname(sock) not in allowed
            ):
                names = f"{p.pid}.sock" + (" or PID-TAG.sock" if str(p.pid) in manifest.pid_ns else "")
                raise _bad(
                    f"{where}: agent_socket {sock!r} is not <agent runtime dir>/{names} "
                    f"(one of {', '.join(sorted(set(allowed)))})"
                )
    if manifest.bytes.device_bytes != sum(p.device_bytes for p in manifest.processes):
        raise _bad("bytes.device_bytes is not the sum of the processes' device_bytes")
    seen: set[str] = set()
    for f in manifest.files:
        parts = f.path.split("/")
        if (
            f.path.startswith("/")
            or os.path.normpath(f.path) != f.path
            or ".." in parts
            or parts[0] not in CHECKSUMMED_SUBDIRS
            or len(parts) < 2
        ):
            under = ", ".join(f"{d}/" for d in CHECKSUMMED_SUBDIRS)
            raise _bad(f"file {f.path!r} is not a path under {under} inside the image")
        if f.path in seen:
            raise _bad(f"file {f.path} is listed twice")
        seen.add(f.path)
        if f.size < 0 or not _DIGEST.fullmatch(f.digest):
            raise _bad(f"file {f.path}: bad size or {f.algo} digest")
    if manifest.files and manifest.bytes.image_bytes != sum(f.size for f in manifest.files):
        raise _bad("bytes.image_bytes is not the sum of the files' sizes")
    for key, value in manifest.timings.to_dict().items():
        if value is not None and value < 0:
            raise _bad(f"timings.{key} is negative")


# --------------------------------------------------------------------------------------------
# Signatures (Ed25519, via the `cryptography` library)
# --------------------------------------------------------------------------------------------

KEYGEN_HELP = (
    "openssl genpkey -algorithm ed25519 -out npusnap-key.pem && "
    "openssl pkey -in npusnap-key.pem -pubout -out npusnap-key.pub.pem"
)


def _read_key_file(path: Path, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(64 * 1024)
    except OSError as exc:
        raise UsageError(
            f"cannot read the {what} {path}: {exc.strerror}", fix=f"check the path; {KEYGEN_HELP}"
        ) from None


def check_signing_key(key_file: Path) -> None:
    """Preflight of ``dump --sign``: refuse a key that cannot sign before anything is locked."""
    _signing_key(key_file)


def _signing_key(key_file: Path) -> Any:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        key = serialization.load_pem_private_key(_read_key_file(key_file, "signing key"), password=None)
    except (ValueError, TypeError) as exc:
        raise UsageError(
            f"{key_file} is not an unencrypted PEM private key: {exc}", fix=f"make one with: {KEYGEN_HELP}"
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise UsageError(f"{key_file} is not an Ed25519 key", fix=f"make one with: {KEYGEN_HELP}")
    return key


def write_signature(image: Path, manifest_bytes: bytes, key_file: Path) -> None:
    """Sign ``manifest_bytes`` with the Ed25519 private key in ``key_file`` (PEM) into the image."""
    key = _signing_key(key_file)
    sig = base64.b64encode(key.sign(manifest_bytes)) + b"\n"
    fd = os.open(image / SIGNATURE_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(sig)
        f.flush()
        os.fsync(f.fileno())


def check_signature(image: Path, manifest_bytes: bytes, pub_file: Path) -> None:
    """Refuse unless ``npusnap.json.sig`` is a valid signature of the manifest by ``pub_file``'s key."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        pub = serialization.load_pem_public_key(_read_key_file(pub_file, "public key"))
    except (ValueError, TypeError) as exc:
        raise UsageError(
            f"{pub_file} is not a PEM public key: {exc}", fix=f"export it with: {KEYGEN_HELP}"
        ) from None
    if not isinstance(pub, Ed25519PublicKey):
        raise UsageError(f"{pub_file} is not an Ed25519 public key", fix=f"make one with: {KEYGEN_HELP}")
    sig_path = image / SIGNATURE_NAME
    try:
        fd = os.open(sig_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise ImageError(
            f"the image {image} is not signed ({SIGNATURE_NAME}: {exc.strerror})",
            why="--require-signature accepts only images that `npusnap dump --sign KEY` signed",
            fix="dump it again with --sign, or drop --require-signature if you trust its source",
        ) from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ImageError(f"{sig_path} is not a regular file", fix=_DO_NOT_USE)
        raw = f.read(4096)
    try:
        pub.verify(base64.b64decode(raw.strip(), validate=True), manifest_bytes)
    except (InvalidSignature, ValueError):
        raise ImageError(
            f"the signature of {image} does not match its manifest or the key {pub_file}",
            why="the manifest (which carries every file's checksum) was changed after it was signed, "
            "or it was signed with another key",
            fix=_DO_NOT_USE,
        ) from None
