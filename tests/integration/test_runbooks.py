"""The runbooks under docs/runbooks/ cannot rot: every page's ```bash blocks, run in order as one
script (docs/runbooks/NAME.sh, generated from the page by scripts/runbooks.py), must succeed
against the simulated NPU and real CRIU; every page links to its script, every script has a page."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest

from tests.conftest import REPO, requires_root

RUNBOOKS = REPO / "docs" / "runbooks"
SCRIPTS = sorted(RUNBOOKS.glob("*.sh"))
PAGES = sorted(p for p in RUNBOOKS.glob("*.md") if p.name != "README.md")
NPUSNAP = REPO / ".venv" / "bin" / "npusnap"
_LINK = re.compile(r"\]\(([^)#\s]+)")


def _runbooks() -> Any:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import runbooks
    finally:
        sys.path.pop(0)
    return runbooks


def _shell_blocks(page: Path) -> list[str]:
    """Every shell block of the page, as a CommonMark renderer finds it (run or only parsed)."""
    return [b.content for b in _runbooks().blocks(page.read_text()) if b.lang in _runbooks().SHELLS]


def _links(page: Path) -> set[str]:
    return set(_LINK.findall(page.read_text()))


def test_there_are_runbooks() -> None:
    assert len(SCRIPTS) >= 5 and len(PAGES) >= 5


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_page_links_its_script(page: Path) -> None:
    script = page.with_suffix(".sh")
    assert script.is_file(), f"{page.name} has no script {script.name}"
    assert script.name in _links(page), f"{page.name} does not link to {script.name}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_script_is_referenced_by_a_page_and_the_index(script: Path) -> None:
    assert any(script.name in _links(p) for p in PAGES), f"no runbook page links to {script.name}"
    index = _links(RUNBOOKS / "README.md")
    assert script.with_suffix(".md").name in index, f"README.md does not list {script.stem}"
    assert os.access(script, os.X_OK), f"{script.name} is not executable"


def test_scripts_are_generated_from_their_pages() -> None:
    """The pages are what is tested: each script is its page's ```bash blocks after a fixed
    prologue (scripts/runbooks.py). A page edited without regenerating its script fails here."""
    runbooks = _runbooks()
    for page in runbooks.pages():  # all but the hand-written ones (runbooks.HAND_WRITTEN)
        blocks = runbooks.runnable_blocks(page)
        assert blocks, f"{page.name} shows no ```bash block"
        script = page.with_suffix(".sh")
        assert script.read_text() == runbooks.render(page), (
            f"{script.name} is out of date with {page.name}: run scripts/runbooks.py"
        )


def test_hand_written_scripts_run_every_block_of_their_page() -> None:
    """podman.sh builds an image first, then runs its page's blocks as shown
    (run_block PAGE N, container-image.bash): every runnable block, each once, in order."""
    runbooks = _runbooks()
    for name in sorted(runbooks.HAND_WRITTEN):
        page = RUNBOOKS / name
        calls = re.findall(rf"^run_block {re.escape(name)} (\d+)$", page.with_suffix(".sh").read_text(), re.M)
        want = list(range(1, len(runbooks.runnable_blocks(page)) + 1))
        assert [int(c) for c in calls] == want, (
            f"{page.with_suffix('.sh').name} runs blocks {calls} of {name}"
        )


# Helper names a page may not use (in command position): no shell defines them, so a pasted page fails.
_HELPERS = re.compile(
    r"(?:^|[;&|(]\s*|\$\(\s*)(npj|fail|state|json|wait_step|last_step|dump_expect|running)(?=\s|$)"
)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_page_blocks_work_when_pasted(page: Path) -> None:
    """What a page shows must work pasted into an interactive shell: no helper functions that only
    a script defines, no `exit` (it would close the operator's shell), no `set -e`. (Undefined
    variables are caught by running the script under `set -u`.)"""
    for block in _shell_blocks(page):
        for line in block.splitlines():
            # Not comments, not single-quoted text (an awk program's `exit` is awk's).
            code = re.sub(r"'[^']*'", "''", line.split(" #", 1)[0])
            assert not re.search(r"(^|[;&|]\s*)(exit|set -e|set -o errexit)\b", code), (
                f"{page.name}: {line!r} would close or change the operator's shell"
            )
            found = _HELPERS.search(code)
            assert not (found and f"{found.group(1)}()" not in block), (
                f"{page.name}: {line!r} uses {found.group(1)}, which the page does not define"
            )


def _user_python() -> Optional[str]:
    """An interpreter an unprivileged user may run, of npusnap's own Python version (permissions.sh
    runs npusnap as that user with npusnap's packages on its path)."""
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    for candidate in (f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.fixture
def device0_taken(sim_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Another job on the host's simulator, holding device 0 while a page runs: a page pasted on
    a shared host must not depend on that device being free."""
    from tests.integration.dumplib import PY, TRAIN, Job

    job = Job(
        tmp_path_factory.mktemp("other-job"),
        dict(sim_env),
        [PY, TRAIN, "--steps", "100000", "--interval", "0.1", "--device", "0"],
        agent=False,
    )
    try:
        job.wait_lines(1)
        yield
        assert job.proc.poll() is None, f"the other job on device 0 died: {job.text()[-500:]}"
    finally:
        job.cleanup()


# The pages that drive the host's one podman or start a containerd on the host's CRI socket paths
# run alone, after the parallel part; the others run on a worker's own node like any test.
HOST_SERVICE_PAGES = ("podman", "kubernetes")


def _script_param(script: Path) -> Any:
    marks = [pytest.mark.serial] if script.stem in HOST_SERVICE_PAGES else []
    return pytest.param(script, id=script.stem, marks=marks)


@pytest.mark.integration
@requires_root
@pytest.mark.parametrize("script", [_script_param(s) for s in SCRIPTS])
def test_runbook_script_succeeds(
    script: Path, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path, device0_taken: None
) -> None:
    env = dict(sim_env)
    env["NPUSNAP_RUNTIME_DIR"] = str(runtime_dir)
    # The container runbooks use this checkout's CRIU plugin, not whatever /usr/lib/criu holds.
    env["NPUSNAP_CRIU_PLUGIN_DIR"] = str(REPO / ".build" / "criu-plugin")
    # Relative to a cwd that is not the repository: the scripts must work from anywhere.
    env["NPUSNAP"] = os.path.relpath(NPUSNAP, tmp_path)
    env.setdefault("PYTHON", shutil.which("python3", path=env.get("PATH")) or sys.executable)
    if script.name == "kubernetes.sh":
        from tests.integration import crilib

        reason = crilib.skip_reason()  # containerd 2.1 of scripts/setup-cri.sh, or NPUSNAP_NO_CRI=1
        if reason is not None:
            pytest.skip(reason)
    if script.name == "torchrun.sh":
        from tests.integration import torchlib

        reason = torchlib.skip_reason()  # the torch virtualenv of scripts/setup-torch.sh
        if reason is not None:
            pytest.skip(reason)
        env["PATH"] = f"{torchlib.TORCH_BIN}{os.pathsep}{env.get('PATH', '')}"
    if script.name == "permissions.sh":
        user_python = _user_python()
        if user_python is None:
            version = f"{sys.version_info[0]}.{sys.version_info[1]}"
            pytest.skip(f"no Python {version} that an unprivileged user may run (/usr/bin, /usr/local/bin)")
        env["USER_PYTHON"] = user_python
    before = set(Path("/tmp").glob("npusnap-runbook.*"))
    proc = subprocess.run(
        [str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False
    )
    assert proc.returncode == 0, f"{script.name} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.rstrip().endswith("OK"), proc.stdout
    # It cleaned up after itself: its work directory (jobs, images, logs) is gone.
    leftover = set(Path("/tmp").glob("npusnap-runbook.*")) - before
    assert not leftover, f"{script.name} left {sorted(leftover)}"


DOC_PAGES = _runbooks().doc_pages()


def test_doc_pages_with_shell_blocks_are_run() -> None:
    """The quickstart is the first page a user pastes from: its blocks run below."""
    assert REPO / "docs" / "quickstart.md" in DOC_PAGES


@pytest.mark.integration
@requires_root
@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: p.stem)
def test_doc_page_blocks_succeed(
    page: Path, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path, device0_taken: None
) -> None:
    """A page outside docs/runbooks/ (the quickstart): its runnable blocks, in order, in a clean
    shell in an empty directory, as the runbooks' scripts run theirs (same prologue)."""
    script = tmp_path / f"{page.stem}.sh"
    script.write_text(_runbooks().render(page))
    script.chmod(0o755)
    env = dict(sim_env)
    env["NPUSNAP_RUNTIME_DIR"] = str(runtime_dir)
    env["NPUSNAP"] = str(NPUSNAP)
    work = tmp_path / "cwd"
    work.mkdir()
    proc = subprocess.run(
        ["bash", str(script)], cwd=work, env=env, capture_output=True, text=True, timeout=180, check=False
    )
    assert proc.returncode == 0, f"{page.name} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.rstrip().endswith("OK"), proc.stdout


def test_hand_written_pages_blocks_run_with_a_stand_in_podman(tmp_path: Path) -> None:
    """Without podman (most machines running the unit tests), every block of podman.md still
    runs as its script runs it (run_block, `set -euo pipefail`), with podman and tail recording
    their arguments: no undefined variable, no missing helper, the files the page writes are
    written. test_runbook_script_succeeds runs it for real where podman is. (kubernetes.md runs
    a containerd of its own: its generated script is run by test_runbook_script_succeeds.)"""
    harness = tmp_path / "harness.sh"
    harness.write_text(
        f"""set -euo pipefail
NPUSNAP={NPUSNAP}
PYTHON=$(dirname "$NPUSNAP")/python  # the blocks run with NPUSNAP=true: page_block's Python from here
. {RUNBOOKS}/container-image.bash
podman() {{ echo "podman $*" >>calls; }}
tail() {{ echo "tail $*" >>calls; }}
WORK=$PWD/work; mkdir -p "$WORK"; C=c1; TAG=t1
NPUSIM_SOCKET=/tmp/npusim-x/npusim.sock
DEVICE_ARGS=($(npu_sim_args))
NPUSNAP_CRIU_PLUGIN_DIR=/plugins
for page in podman.md; do
    n=$("$PYTHON" {REPO}/scripts/runbooks.py --count "{RUNBOOKS}/$page")
    for i in $(seq "$n"); do NPUSNAP=true run_block "$page" "$i" >/dev/null; done
done
"""
    )
    proc = subprocess.run(["bash", str(harness)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    calls = (tmp_path / "calls").read_text()
    assert "--annotation org.criu.config=" in calls and "-e NPUSNAP_AGENT=1" in calls
    assert "podman container restore --import=" in calls
    assert (tmp_path / "work" / "criu.conf").read_text() == "libdir /plugins\n"
