"""`moga data`: get the public datasets the loaders read (registered in :mod:`moga.cli`)."""

from __future__ import annotations

from pathlib import Path

import typer

from .fetch import REMOTES, FetchError, fetch

data_app = typer.Typer(no_args_is_help=True, add_completion=False, help="Datasets: download where a network exists.")


@data_app.command("fetch")
def fetch_command(
    name: str = typer.Argument(..., help=f"dataset: {', '.join(REMOTES)}"),
    dest: Path = typer.Option(None, help="directory to put it in (default: the user data folder, "
                              "$MOGA_CACHE/data or ~/.cache/moga/data, where runs find it)"),
    url: str = typer.Option(None, help="another source (a mirror or a file:// copy); size and SHA-256 are checked"),
) -> None:
    """Download a dataset, check its size and SHA-256, and store it where moga's loaders look."""
    try:
        path = fetch(name, dest, url)
    except (ValueError, FetchError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{REMOTES[name].about}: {path}")
