"""The ``kvpath`` command line."""

# The entry point is the only module that imports every part: each part adds its own
# subcommands (``add_parsers``) and imports what a command needs only when it runs.

from __future__ import annotations

import argparse
import sys

from kvpath import __version__
from kvpath.logs import configure as configure_logging


def build_parser() -> argparse.ArgumentParser:
    from kvpath.bridge.cli import add_parsers as add_bridge_parsers
    from kvpath.connector.cli import add_parsers as add_connector_group
    from kvpath.demo.cli import add_parsers as add_demo_parsers
    from kvpath.proxy.cli import add_parsers as add_proxy_parsers
    from kvpath.reservation.cli import add_parsers as add_reservation_parsers
    from kvpath.testbed.cli import add_parsers as add_testbed_parsers
    from kvpath.testbed.connector_demo import add_parsers as add_connector_demo
    from kvpath.tiny_model import add_parsers as add_model_parsers

    p = argparse.ArgumentParser(prog="kvpath", description=__doc__)
    p.add_argument("--version", action="version", version=f"kvpath {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command")
    # this order is the order ``kvpath --help`` lists them in
    add_demo_parsers(sub)
    add_model_parsers(sub)
    add_connector_demo(add_connector_group(sub))
    add_reservation_parsers(sub)
    add_proxy_parsers(sub)
    add_testbed_parsers(sub)
    add_bridge_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
