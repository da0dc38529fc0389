"""``python -m streams.simulator``: run the provider simulator (see :mod:`streams.simulator.cli`)."""

from streams.simulator.cli import command

if __name__ == "__main__":
    command(prog_name="python -m streams.simulator")
