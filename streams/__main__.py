"""``python -m streams``: the same command line as ``streams``."""

from streams.cli import main

main(prog_name="streams")
