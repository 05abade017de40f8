"""`npusnap list DIR`, `npusnap export IMG FILE`, `npusnap import FILE DIR`: managing images."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from npusnap_cli.commands._common import JSON_HELP, epilog, output
from npusnap_cli.commands._progress import ProgressBars
from npusnap_cli.errors import UsageError
from npusnap_cli.image import archive, imagestore
from npusnap_cli.units import human_bytes


def register(app: typer.Typer) -> None:
    @app.command("list", epilog=epilog("list"))
    def list_cmd(
        ctx: typer.Context,
        # readable=False: click would call root's image a usage error (2); npusnap's own open
        # meets the EACCES and says that root is needed (3).
        directory: Path = typer.Argument(
            ..., readable=False, metavar="DIR", help="The directory that holds the images (their parent)."
        ),
        checksums: bool = typer.Option(
            False,
            "--checksums",
            "-c",
            help="Also hash every file of every image (reads them all: seconds per GiB); by default "
            "an image is valid if its manifest parses and its files have the listed sizes, an "
            "archive if its manifest parses. `npusnap verify IMAGE` checks one image fully.",
        ),
        quick: bool = typer.Option(
            False, "--quick", hidden=True, help="No hashing: the default (accepted for scripts that pass it)."
        ),
        valid_only: bool = typer.Option(False, "--valid", help="List only the valid images."),
        paths_only: bool = typer.Option(
            False, "--paths", help="Print only the paths, newest first, one per line (for scripts)."
        ),
        json_flag: bool = typer.Option(False, "--json", help=JSON_HELP),
    ) -> None:
        """List the images (directories and archives) under DIR, newest first.

        Each with its time, size, pids and whether it is valid (manifest, files, sizes and, with
        --checksums, every file's checksum). The newest valid one:
        `npusnap list --valid --paths DIR | head -n 1`. Exit 0 even if some are invalid; 2 if DIR
        is not a directory.
        """

        out = output(ctx, "list", json_flag)
        images = imagestore.list_images(directory, quick=not checksums)
        if valid_only:
            images = [i for i in images if i.valid]
        if paths_only:
            for info in images:
                out.data(info.path)
        else:
            out.table(
                f"images in {directory}",
                ["created (UTC)", "path", "size", "pids", "valid"],
                [
                    (
                        (i.created_at or "-").replace("+00:00", "Z"),
                        i.path + (" (latest)" if i.latest else ""),
                        human_bytes(i.size_bytes),
                        ",".join(map(str, i.pids)) or "-",
                        ("yes" if i.valid else f"NO: {i.problem}")
                        + (" (no checksums)" if i.valid and i.checked != "checksums" else ""),
                    )
                    for i in images
                ],
                styles=[None if i.valid else "red" for i in images],
            )
        out.result({"directory": str(directory), "images": [i.to_dict() for i in images]})

    @app.command("export", epilog=epilog("export"))
    def export_cmd(
        ctx: typer.Context,
        image_dir: Path = typer.Argument(
            ..., readable=False, metavar="IMAGE", help="The image directory to export."
        ),
        dest: Optional[Path] = typer.Argument(
            None, metavar="[FILE]", help="The archive to write (default: IMAGE.tar.zst next to IMAGE)."
        ),
        compress: str = typer.Option(
            "zstd",
            "--compress",
            metavar="zstd|none",
            help="zstd (default; every core) or none (a plain tar: for data that does not compress, "
            "or a store that compresses by itself). `inspect`, `verify`, `import` read both.",
        ),
        level: Optional[int] = typer.Option(
            None, "--level", min=1, max=19, help="zstd compression level (1-19, default 3)."
        ),
        threads: int = typer.Option(
            0, "--threads", min=0, help="Compression threads (default 0: one per CPU core)."
        ),
        force: bool = typer.Option(False, "--force", help="Replace FILE if it exists."),
        json_flag: bool = typer.Option(False, "--json", help=JSON_HELP),
    ) -> None:
        """Write an image into one archive (tar + zstd on every core, or a plain tar with --compress
        none), verified on the way.

        Every file is checked against its checksum while it is written: a corrupt image is never
        exported. The archive (mode 0600: it holds the processes' memory) is written to a
        temporary name and renamed when complete. `inspect` and `verify` read it directly;
        `npusnap import FILE DIR` turns it back into an image. Prints the archive's path.
        """

        out = output(ctx, "export", json_flag)
        if compress not in archive.COMPRESSIONS:
            raise UsageError(
                f"--compress {compress!r} is not one of {', '.join(archive.COMPRESSIONS)}",
                fix=f"npusnap export {image_dir} --compress zstd (or none)",
            )
        if compress == "none" and level is not None:
            raise UsageError(
                "--level is a zstd level: it means nothing with --compress none",
                fix="drop --level, or use --compress zstd",
            )
        target = dest if dest is not None else image_dir.parent / archive.default_name(image_dir, compress)
        bars = ProgressBars(out)
        done = [0]

        def advance(n: int) -> None:
            done[0] += n
            bars.update("exporting", done[0], None)

        try:
            result = archive.export(
                image_dir,
                target,
                level=archive.DEFAULT_LEVEL if level is None else level,
                threads=threads or -1,
                force=force,
                progress=advance,
                compress=compress,
            )
        finally:
            bars.close()
        out.ok(
            f"exported {image_dir} ({result.files} files, {human_bytes(result.bytes_in)}) "
            f"to {result.archive} ({human_bytes(result.bytes_out)}) in {result.seconds:.2f}s"
        )
        out.data(result.archive)
        out.result(result.to_dict())

    @app.command("import", epilog=epilog("import"))
    def import_cmd(
        ctx: typer.Context,
        source: Path = typer.Argument(
            ..., readable=False, metavar="FILE", help="The archive written by `npusnap export`."
        ),
        directory: Path = typer.Argument(
            ..., metavar="DIR", help="The image directory to create (new or empty)."
        ),
        force: bool = typer.Option(False, "--force", help="Replace DIR if it exists and is not empty."),
        json_flag: bool = typer.Option(False, "--json", help=JSON_HELP),
    ) -> None:
        """Extract an archive into a new image directory, verified, ready for `npusnap restore`.

        Every file is checked against the manifest's checksum as it is extracted; only plain files
        under the image's own directory are accepted. The image appears under its final name only
        when complete (a temporary sibling, renamed). Prints the image's path.
        """
        out = output(ctx, "import", json_flag)
        result = import_into(out, source, directory, force=force)
        out.data(result.image)
        out.result(result.to_dict())


def import_into(out: Any, source: Path, directory: Path, *, force: bool) -> archive.ImportResult:
    """`npusnap import`, also for `restore --import`: extract, verified, with a progress bar."""

    bars = ProgressBars(out)
    done = [0]

    def advance(n: int) -> None:
        done[0] += n
        # No total: the archive's size counts compressed bytes, not the bytes extracted.
        bars.update("importing", done[0], None)

    try:
        result = archive.import_archive(source, directory, force=force, progress=advance)
    finally:
        bars.close()
    out.ok(
        f"imported {source} into {result.image}: {result.files} files, "
        f"{human_bytes(result.image_bytes)}, checksums match"
    )
    return result
