"""`npusnap demo`: dump and restore a training job on the simulated NPU (a real torch_npu model where
the torch_npu venv is built), and prove continuity."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from npusnap_cli.commands._common import JSON_HELP, epilog, output
from npusnap_cli.errors import UsageError
from npusnap_cli.ui import human_bytes
from npusnap_workloads import demo as core


def register(app: typer.Typer) -> None:
    @app.command(epilog=epilog("demo"))
    def demo(
        ctx: typer.Context,
        steps: int = typer.Option(40, "--steps", min=4, help="Training steps of the workload."),
        dump_after: int = typer.Option(
            12, "--dump-after", min=1, help="Dump once this many steps are printed."
        ),
        interval: float = typer.Option(0.1, "--interval", min=0.0, help="Seconds between training steps."),
        workload: str = typer.Option(
            "auto",
            "--workload",
            help="auto: torch_npu where its venv (.build/torch-npu) is built, else compute; torch_npu: "
            "torch_npu_block.py (an attention block trained by the real torch_npu wheel); compute: "
            "npu_train.py (aclnn operators on streams); memory: train.py (device memory updated "
            "through host copies).",
        ),
        hidden: int = typer.Option(64, "--hidden", min=1, help="Hidden units of the compute workload's MLP."),
        param_mib: int = typer.Option(
            16, "--param-mib", min=1, help="Device memory of the memory workload's model, in MiB."
        ),
        workdir: Optional[Path] = typer.Option(
            None, "--workdir", help="Where to put the log and the image (default: a new temporary directory)."
        ),
        keep: bool = typer.Option(False, "--keep", help="Keep the image for `npusnap inspect`."),
        json_flag: bool = typer.Option(False, "--json", help=JSON_HELP),
    ) -> None:
        """Run the main job: a training workload on the simulated NPU is dumped, restored and checked.

        Starts the simulated NPU, runs a deterministic training job under `npusnap run`, so it has
        an agent: a real torch_npu model (an attention block, AdamW) where the torch_npu venv is
        built (`make demo` builds it; otherwise the demo says why and takes the built-in job that
        computes on the device with aclnn operators). Dumps it mid-run (the process is gone),
        restores it, lets it finish and compares its whole output (loss and a hash of the
        parameters per step) with an uninterrupted reference run. Exit 0 only if the output is
        identical; 10 if it is not.
        """

        if dump_after >= steps:
            raise UsageError(
                "--dump-after must be smaller than --steps", fix="e.g. --steps 40 --dump-after 12"
            )
        if workload not in (core.AUTO, *core.WORKLOADS):
            raise UsageError(
                f"unknown --workload {workload!r}", fix="--workload auto, torch_npu, compute or memory"
            )
        out = output(ctx, "demo", json_flag)
        settings = core.DemoSettings(
            steps=steps,
            dump_after=dump_after,
            interval_s=interval,
            param_bytes=param_mib << 20,
            workdir=workdir,
            keep=keep,
            workload=workload,
            hidden=hidden,
        )
        result = core.run_demo(settings, lambda phase, msg: out.line(f"[{phase}] {msg}"))

        dump_t = {k: v for k, v in (result.dump.get("timings") or {}).items() if v is not None}
        rows = [(name, f"{secs:.2f} s") for name, secs in result.phases_s.items()]
        out.table("demo phases (wall clock)", ["phase", "time"], rows)
        if dump_t:
            out.table(
                "dump timings (manifest)",
                ["phase", "seconds"],
                [(k.removesuffix("_s"), f"{v:.3f}") for k, v in dump_t.items()],
            )
        image_bytes = (result.dump.get("bytes") or {}).get("image_bytes")
        described = {
            "torch_npu": f"torch_npu_block.py, {steps} steps, an attention block trained by torch_npu",
            "compute": f"npu_train.py, {steps} steps, an MLP of {hidden} hidden units (aclnn operators)",
            "memory": f"train.py, {steps} steps, {param_mib} MiB of device memory",
        }
        out.kv(
            "summary",
            {
                "workload": described[result.workload],
                **(
                    {"torch_npu": f"not used: {result.torch_npu_unavailable}"}
                    if result.torch_npu_unavailable
                    else {}
                ),
                **({"dump caught the job in": result.dump_caught} if result.dump_caught else {}),
                "dumped pid": result.original_pid,
                "lines before the dump": result.lines_before_dump,
                "restored pid": result.restored_pid,
                "image size": human_bytes(image_bytes) if image_bytes else "-",
                "job frozen for": f"{dump_t['frozen_s']:.3f} s" if "frozen_s" in dump_t else "-",
                "image": result.image or "(removed; use --keep to keep it)",
                "continuity": f"identical: {result.lines_total} of {result.reference_lines} reference lines",
            },
        )
        out.ok("the restored workload carried on exactly where it stopped")
        out.result(result.to_dict())
