"""``python -m streams_harness.simulator``: run the provider simulator (see :mod:`streams_harness.simulator.cli`)."""

from streams_harness.simulator.cli import command

if __name__ == "__main__":
    command(prog_name="python -m streams_harness.simulator")
