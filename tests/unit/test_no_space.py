"""A full disk is one failure class with one exit code, whichever command and stage it hits.

The expected codes are read from docs/exit-codes.md's table (the row whose meaning names disk
space, the row of a bad command line), not written here: the test checks the code against what
the operators' page promises. Each case injects the failure where it happens: an archive's
compressor (zstandard wraps the failed write in its own ZstdError), import's writes, CRIU's
log, the agent's copy of the device memory, a pipeline step's write (dump and restore), a bug
path that only the CLI's last net sees.
"""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path
from typing import Any

import pytest

from npusnap_cli import criu, ui
from npusnap_cli.cli import main
from npusnap_cli.criu import failures as criu_failures
from npusnap_cli.device import agent_client, protocol
from npusnap_cli.errors import ImageError, NpusnapError, StateUnknownError, UsageError
from npusnap_cli.image import archive, publishing
from npusnap_cli.pipelines.engine import Pipeline, Step
from tests import replies
from tests.unit.test_image import _build, _manifest

DOC = Path(__file__).resolve().parents[2] / "docs" / "exit-codes.md"


def _code_for(words: str) -> int:
    """The code of the table row whose meaning contains ``words``."""
    rows = re.findall(r"^\|\s*(\d+)\s*\|\s*[A-Z_]+\s*\|[^|]*\|([^|]*)\|", DOC.read_text(), re.MULTILINE)
    found = [int(code) for code, meaning in rows if words in meaning]
    assert len(found) == 1, (words, rows)
    return found[0]


NO_SPACE = _code_for("disk space")
USAGE = _code_for("bad command line")


def _enospc(path: str = "/img/x") -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", path)


def test_the_doc_names_one_code_for_a_full_disk_in_every_command() -> None:
    """The cases the page names (dump, export, import) say the table's code, not a stage's."""
    text = " ".join(DOC.read_text().split())
    case = re.search(r"\* a disk \(or quota\) that fills up(.*?);", text)
    assert case is not None
    named = case.group(1)
    assert f": {NO_SPACE}," in named and all(f"`{c}`" in named for c in ("dump", "export", "import")), named


@pytest.fixture
def small_image(tmp_path: Path) -> Path:
    tmp, final = _build(tmp_path, "img")
    publishing.publish(tmp, final, _manifest(publishing.file_entries(tmp)))
    return final


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    rc = main(["--json", *argv])
    return rc, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("wrapped", [False, True])
def test_export_onto_a_full_disk(
    small_image: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    wrapped: bool,
) -> None:
    import zstandard

    real = zstandard.ZstdCompressor

    class Full:
        """A compressor whose output file is full: the write fails as the OS says, or (at
        zstandard's flush) as a ZstdError raised while handling that OSError."""

        def __init__(self, **kw: Any) -> None:
            self.real = real(**kw)

        def stream_writer(self, fh: Any, **kw: Any) -> Any:
            class Writer:
                def __enter__(self) -> Writer:
                    return self

                def __exit__(self, *exc: object) -> None:
                    if wrapped and exc[0] is not None:
                        raise zstandard.ZstdError("zstd compress error: Operation not authorized")

                def write(self, _data: bytes) -> int:
                    raise _enospc(str(tmp_path / "out" / "a.tar.zst"))

                def flush(self, *_a: Any) -> None:
                    pass

            return Writer()

    monkeypatch.setattr(zstandard, "ZstdCompressor", Full)
    (tmp_path / "out").mkdir()
    rc, env = _run(["export", str(small_image), str(tmp_path / "out" / "a.tar.zst")], capsys)
    assert rc == NO_SPACE and env["error"]["exit_code"] == NO_SPACE, env["error"]
    assert "no space left" in env["error"]["message"]
    assert list((tmp_path / "out").iterdir()) == []  # nothing partial is left


def test_import_onto_a_full_disk(
    small_image: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    arch = tmp_path / "a.tar.zst"
    archive.export(small_image, arch)

    def full(_tree: Path) -> None:
        raise _enospc()

    monkeypatch.setattr(archive.publishing, "fsync_tree", full)
    rc, env = _run(["import", str(arch), str(tmp_path / "imported")], capsys)
    assert rc == NO_SPACE, env["error"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".imported", "imported"))]


@pytest.mark.parametrize("what", ["symlink", "file"])
def test_import_into_a_destination_that_is_not_a_new_directory(
    small_image: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], what: str
) -> None:
    """Not an invalid archive (8): a destination the operator named that cannot be one (2)."""
    arch = tmp_path / "a.tar.zst"
    archive.export(small_image, arch)
    dest = tmp_path / "dest"
    if what == "symlink":
        (tmp_path / "elsewhere").mkdir()
        dest.symlink_to(tmp_path / "elsewhere")
    else:
        dest.write_text("x")
    rc, env = _run(["import", str(arch), str(dest)], capsys)
    assert rc == USAGE, env["error"]
    assert env["error"]["kind"] == "usage"


def test_criu_on_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dump's or restore's CRIU that ran out of space (also when a plugin's write is what
    failed): the table's code, not CRIU's."""

    class Exc(Exception):
        errno = 0

    log = tmp_path / "logs" / "dump.log"
    log.parent.mkdir()
    log.write_text(
        "(00.1) Error (criu/image.c:1): Can't write: No space left on device\n"
        "(00.2) Error (criu/plugin.c:2): [npusim-plugin fini-dump err]\n"
    )
    monkeypatch.setattr(criu_failures, "_free_bytes", lambda _p: 10 << 30)
    for action in ("dump", "restore"):
        err = criu._criu_error(action, Exc("Error(0): Unknown"), str(log), pid=42)
        assert int(err.exit_code) == NO_SPACE, err.message
        assert err.details["criu_log"] == str(log)


def test_criu_log_cut_short_by_the_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CRIU's log on the disk that filled: its last error line is cut mid-word (seen on a busy
    machine). Still a full disk: 3, not CRIU's 6."""

    class Exc(Exception):
        errno = 0

    log = tmp_path / "logs" / "dump.log"
    log.parent.mkdir()
    log.write_text("(00.03) Error (criu/page-xfer.c:263): page-xfer: Unable to spice data: No space left o")
    monkeypatch.setattr(criu_failures, "_free_bytes", lambda _p: 10 << 30)
    err = criu._criu_error("dump", Exc("DUMP failed: Error(0): Unknown"), str(log), pid=42)
    assert int(err.exit_code) == NO_SPACE, err.message


def test_the_agents_copy_of_device_memory_on_a_full_disk() -> None:
    client = agent_client.AgentClient(42, connect=False)
    error = replies.error(
        protocol.ERR_STATE,
        protocol.DEVICE_MEMORY_SAVE_FAILED,
        "cannot write the device-memory file: No space left on device",
        code=-errno.ENOSPC,
    )
    err = client._error("lock", error)
    assert isinstance(err, NpusnapError) and int(err.exit_code) == NO_SPACE


@pytest.mark.parametrize(
    "fail",
    [
        lambda: (_ for _ in ()).throw(_enospc()),  # a bare OSError from a step's write
        lambda: _raise_from(ImageError("writing the image failed"), _enospc()),
        lambda: _raise_from(UsageError("could not write the pidfile"), _enospc()),
    ],
)
def test_a_pipeline_step_on_a_full_disk(fail: Any) -> None:
    """Dump and restore run their steps in the engine: whatever a step made of the ENOSPC, the
    failure comes out with the table's code, after the undo."""
    undone: list[str] = []
    steps = [
        Step("first", lambda s: None, undo=lambda s, e: undone.append("first")),
        Step("write", lambda s: fail()),
    ]
    with pytest.raises(NpusnapError) as exc:
        Pipeline("dump", steps).run(object())
    assert int(exc.value.exit_code) == NO_SPACE and undone == ["first"]


def test_a_failed_rollback_is_still_state_unknown() -> None:
    def fail(_s: object) -> None:
        _raise_from(StateUnknownError("rollback failed"), _enospc())

    with pytest.raises(StateUnknownError):
        Pipeline("dump", [Step("x", fail)]).run(object())


def test_the_clis_last_net(capsys: pytest.CaptureFixture[str]) -> None:
    """A library's own exception around a full disk, outside any pipeline: not a bug (1)."""

    class LibraryError(Exception):
        pass

    try:
        try:
            raise _enospc()
        except OSError:
            raise LibraryError("compress error") from None
    except LibraryError as exc:
        rc = ui.unexpected(ui.Output("export", json_mode=True), exc)
    assert rc == NO_SPACE
    assert json.loads(capsys.readouterr().out)["error"]["kind"] == "preflight"


def _raise_from(err: Exception, cause: BaseException) -> None:
    try:
        raise cause
    except BaseException:
        raise err from None


def test_restore_dry_run_reports_a_full_disk_with_the_tables_code(
    small_image: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`restore --dry-run` exits with its first problem's code: a check that ran out of space
    (CRIU's log directory, a pidfile's) is the table's code there too."""
    from npusnap_cli.pipelines import restorecheck
    from npusnap_cli.pipelines.restore import Check, RestoreOptions

    def full(_pf: object) -> str:
        _raise_from(UsageError("cannot write CRIU's restore log"), _enospc())
        return ""

    monkeypatch.setattr(restorecheck, "CHECKS", [Check("logs", "where CRIU's log goes", full)])
    [result] = restorecheck.run_checks(small_image, RestoreOptions())
    assert result.status == "problem" and result.exit_code == NO_SPACE
