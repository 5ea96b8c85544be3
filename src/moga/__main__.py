"""`python -m moga ...` and the `moga` console script."""

from moga.extras import cli_extra


def main() -> None:
    with cli_extra():  # the command's modules import the cli extra: without it, say so in one line
        from moga.cli import main as run
    run()


if __name__ == "__main__":
    main()
