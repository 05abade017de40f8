"""Placeholder until the `inspect` command lands (registers nothing)."""

import typer


def register(app: typer.Typer) -> None:
    del app
