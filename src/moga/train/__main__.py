"""`python -m moga.train CONFIG [KEY=VALUE]...`: `moga train` for launchers that take a module, like torchrun."""

import typer

from moga.train.cli import train

if __name__ == "__main__":
    typer.run(train)
