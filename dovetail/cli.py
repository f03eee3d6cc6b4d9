"""The `dovetail` command: train, pretrain, simulate, plan."""

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)


if __name__ == "__main__":
    app()
