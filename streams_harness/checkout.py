"""The clone of the repository the harness runs in: the main job and the soak use its ``Procfile``,
``scripts/services``, ``scripts/toxiproxy`` and write to its ``reports/``."""

from __future__ import annotations

from pathlib import Path

from streams.errors import StreamsError

#: Files that mark a clone of this repository.
MARKERS = ("Procfile", "scripts/services", "pyproject.toml")


class CheckoutNotFoundError(StreamsError):
    """The harness was started outside a clone of the repository; the message says where it looked."""


def checkout_dir(start: Path | None = None) -> Path:
    """The nearest directory at or above ``start`` (default: the current directory) that holds every file of
    :data:`MARKERS`.

    Raises:
        CheckoutNotFoundError: none does (run the main job and the soak from a clone of the repository).
    """
    here = (start or Path.cwd()).resolve()
    for candidate in (here, *here.parents):
        if all((candidate / marker).is_file() for marker in MARKERS):
            return candidate
    raise CheckoutNotFoundError(
        f"no clone of the repository at or above {here} (looked for {', '.join(MARKERS)}): the main job and the "
        "soak run the Procfile and scripts/ of a clone; run them from one"
    )
