"""`python -m moga ...` is the `moga` command."""

from moga.cli import main

main()
