"""`npusnap k8s checkpoint|verify`: a coordinated checkpoint of a job's containers across pods
(npusnap_cli/k8s/jobcheckpoint.py; docs/runbooks/kubernetes.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from npusnap_cli.commands._common import JSON_HELP, epilog, output
from npusnap_cli.errors import UsageError
from npusnap_cli.image import k8sjob
from npusnap_cli.k8s import jobcheckpoint as jc
from npusnap_cli.k8s.cri import CriClient
from npusnap_cli.ui import human_bytes


def register(app: typer.Typer) -> None:
    k8s = typer.Typer(
        name="k8s",
        help="Kubernetes: checkpoint a job's containers across pods together (kubelet or CRI).",
        no_args_is_help=True,
    )

    @k8s.command("checkpoint", epilog=epilog("k8s checkpoint"))
    def checkpoint_cmd(
        ctx: typer.Context,
        directory: Path = typer.Argument(
            ..., help="New directory for the job's archives and npusnap-k8s-job.json.", metavar="DIR"
        ),
        member: list[str] = typer.Option(
            ...,
            "--member",
            help="NAMESPACE/POD/CONTAINER[@NODE] of one container of the job; repeat, in NPUSNAP_JOB_MEMBER "
            "order (0, 1, ...).",
        ),
        listen: Optional[str] = typer.Option(
            None,
            "--listen",
            help="HOST:PORT to serve the job's barriers on: the NPUSNAP_JOB_COORDINATOR the pods name "
            "(needed for more than one --member).",
        ),
        cri_endpoint: Optional[str] = typer.Option(
            None,
            "--cri-endpoint",
            help="Checkpoint through this node's CRI runtime (unix:///run/containerd/containerd.sock) "
            "instead of the kubelets; every member must run on this node.",
        ),
        kubelet_cert: Optional[Path] = typer.Option(
            None, "--kubelet-cert", help="Client certificate for the kubelets' API (kubelet mode)."
        ),
        kubelet_key: Optional[Path] = typer.Option(None, "--kubelet-key", help="Its private key."),
        kubelet_ca: Optional[Path] = typer.Option(
            None, "--kubelet-ca", help="CA of the kubelets' serving certificates (default: not verified)."
        ),
        timeout: float = typer.Option(
            600.0, "--timeout", help="Seconds each container's checkpoint may take."
        ),
        barrier_timeout: float = typer.Option(
            600.0, "--barrier-timeout", help="Seconds a barrier waits for the last member."
        ),
        json_flag: bool = typer.Option(False, "--json", help=JSON_HELP),
    ) -> None:
        """Checkpoint every --member at once; their CRIU plugins hold the job's barriers (all locked
        before any is dumped, none let go before all are saved). Any failure rolls every container
        back (they keep running) and removes the archives."""

        out = output(ctx, "k8s checkpoint", json_flag)
        members = [jc.parse_member(i, text) for i, text in enumerate(member)]
        backend: jc.Backend
        if cri_endpoint:
            backend = jc.CriBackend(cri_endpoint)
        elif kubelet_cert and kubelet_key:
            backend = jc.KubeletBackend(kubelet_cert, kubelet_key, kubelet_ca)
        else:
            raise UsageError(
                "say where the checkpoint calls go: --cri-endpoint, or --kubelet-cert and --kubelet-key",
                fix="on a cluster: the API server's kubelet client certificate; on a node: the CRI socket",
            )
        with out.phase(f"checkpointing {len(members)} containers behind the job's barriers"):
            result = jc.checkpoint_job(
                members,
                directory,
                backend,
                jc.parse_listen(listen) if listen else None,
                timeout_s=timeout,
                barrier_timeout_s=barrier_timeout,
                local_archives=cri_endpoint is not None,
            )
        rows = [
            [
                str(m["member"]),
                f"{m['namespace']}/{m['pod']}/{m['container']}",
                str(m["archive"]),
                human_bytes(int(m["size"])) if m.get("size") is not None else "on its node",
                f"{m['seconds']:.2f}s",
            ]
            for m in result.manifest["members"]
        ]
        out.table("job checkpoint", ["member", "container", "archive", "size", "took"], rows)
        out.ok(f"checkpointed {len(members)} containers together into {result.directory}")
        out.result({"directory": str(result.directory), "manifest": result.manifest})

    @k8s.command("restore", epilog=epilog("k8s restore"))
    def restore_cmd(
        ctx: typer.Context,
        directory: Path = typer.Argument(
            ..., help="A directory written by `npusnap k8s checkpoint`.", metavar="DIR"
        ),
        listen: Optional[str] = typer.Option(
            None,
            "--listen",
            help="HOST:PORT of the barrier; default: the coordinator the job was checkpointed with, which "
            "its restored processes name.",
        ),
        cri_endpoint: Optional[str] = typer.Option(
            None,
            "--cri-endpoint",
            help="Create the members' containers through this node's CRI (with --run).",
        ),
        run: list[str] = typer.Option(
            [],
            "--run",
            help="POD.json:CONTAINER.json for one member, in member order: its new pod (CRI JSON, as for "
            "`npusnap k8s run`); the container's image is replaced by the member's archive.",
        ),
        barrier_timeout: float = typer.Option(
            600.0, "--barrier-timeout", help="Seconds the barrier waits for the last member."
        ),
        json_flag: bool = typer.Option(False, "--json", help=JSON_HELP),
    ) -> None:
        """Restore a job checkpoint together: every member's NPU processes stay locked until every
        member is restored. With --cri-endpoint and --run, creates the members' pods itself; without,
        serves the barrier while the pods are created from the archives (kubectl)."""
        import json

        out = output(ctx, "k8s restore", json_flag)
        runner = None
        if run:
            if not cri_endpoint:
                raise UsageError("--run needs --cri-endpoint", fix="add the node's CRI socket")

            configs = []
            for spec in run:
                pod_path, sep, ctr_path = spec.partition(":")
                if not sep:
                    raise UsageError(f"--run {spec!r} is not POD.json:CONTAINER.json")
                try:
                    configs.append(
                        (json.loads(Path(pod_path).read_text()), json.loads(Path(ctr_path).read_text()))
                    )
                except (OSError, ValueError) as exc:
                    raise UsageError(f"cannot read {spec}: {exc}") from None
            endpoint = cri_endpoint

            def runner(member: dict[str, object], archive: Path) -> dict[str, str]:
                index = int(str(member["member"]))
                if index >= len(configs):
                    raise UsageError(
                        f"no --run for member {index}", fix="give one --run per member, in order"
                    )
                pod, container = configs[index]
                with CriClient(endpoint) as cri:
                    pod_id, cid = cri.run_pod(
                        pod, {**container, "image": {"image": str(archive)}}, timeout=barrier_timeout + 60
                    )
                return {"member": str(index), "pod_id": pod_id, "container_id": cid}

        with out.phase("restoring the job's members behind the barrier"):
            res = jc.restore_job(
                directory,
                jc.parse_listen(listen) if listen else None,
                runner,
                barrier_timeout_s=barrier_timeout,
            )
        for made in res["created"]:
            out.data(f"{made['pod_id']} {made['container_id']}")
        out.ok(f"{res['members']} members restored together from {directory}")
        out.result(res)

    @k8s.command("run", epilog=epilog("k8s run"))
    def run_cmd(
        ctx: typer.Context,
        pod_config: Path = typer.Argument(
            ..., help="The pod's CRI PodSandboxConfig as JSON (crictl's pod.json)."
        ),
        container_config: Path = typer.Argument(
            ..., help="The container's CRI ContainerConfig as JSON; its image may be a checkpoint."
        ),
        cri_endpoint: str = typer.Option(..., "--cri-endpoint", help="The node's CRI socket (unix:///...)."),
        json_flag: bool = typer.Option(False, "--json", help=JSON_HELP),
    ) -> None:
        """Run a one-container pod through the node's CRI, as the kubelet would (`crictl run`), and
        print "POD_ID CONTAINER_ID". With a checkpoint archive as the container's image, containerd
        restores the container from it."""
        import json

        out = output(ctx, "k8s run", json_flag)
        try:
            pod = json.loads(pod_config.read_text())
            container = json.loads(container_config.read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot read the CRI configs: {exc}", fix="give two JSON files") from None
        with CriClient(cri_endpoint) as cri:
            pod_id, cid = cri.run_pod(pod, container)
        out.data(f"{pod_id} {cid}")
        out.result({"pod_id": pod_id, "container_id": cid})

    @k8s.command("rm", epilog=epilog("k8s rm"))
    def rm_cmd(
        ctx: typer.Context,
        pod_id: str = typer.Argument(..., help="The pod sandbox's id (`npusnap --json k8s run` prints it)."),
        cri_endpoint: str = typer.Option(..., "--cri-endpoint", help="The node's CRI socket (unix:///...)."),
        json_flag: bool = typer.Option(False, "--json", help=JSON_HELP),
    ) -> None:
        """Stop and remove a pod through the node's CRI (`crictl rmp -f`)."""

        out = output(ctx, "k8s rm", json_flag)
        with CriClient(cri_endpoint) as cri:
            cri.remove_pod(pod_id)
        out.ok(f"pod {pod_id} stopped and removed")
        out.result({"pod_id": pod_id})

    @k8s.command("verify", epilog=epilog("k8s verify"))
    def verify_cmd(
        ctx: typer.Context,
        directory: Path = typer.Argument(
            ..., help="A directory written by `npusnap k8s checkpoint`.", metavar="DIR"
        ),
        json_flag: bool = typer.Option(False, "--json", help=JSON_HELP),
    ) -> None:
        """Check every archive the job manifest names (size, sha256, and the plugin's record of each
        image file inside)."""

        out = output(ctx, "k8s verify", json_flag)
        res = k8sjob.verify_job(directory)
        out.ok(f"{directory}: {res['members']} archives match the job manifest")
        out.result(res)

    app.add_typer(k8s)
