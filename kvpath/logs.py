"""How kvpath's processes log: one format, the level from ``-v``. The ``kvpath`` command
sets it up once; a process started apart from it (an emulated engine, a spawned proxy
worker) sets it up the same way, since it inherits nothing of the parent's."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format=FORMAT)
