"""``kvpath connector ...``: the connector's own commands (``keys``); the testbed adds
``demo`` to the same group."""

from __future__ import annotations

import argparse
import json
import logging

logger = logging.getLogger(__name__)


def _cmd_keys(args: argparse.Namespace) -> int:
    from kvpath.connector.control_auth import make_keys, pd_keys

    try:
        if args.name:
            pub, sec = make_keys(args.dir, args.name)
            print(json.dumps({"public": str(pub), "secret": str(sec)}, indent=2))
        else:
            print(json.dumps(pd_keys(args.dir), indent=2))
    except (FileExistsError, OSError) as e:
        logger.error("kvpath connector keys: %s", e)
        return 2
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """Adds ``kvpath connector``; returns its subcommand group for other parts' verbs."""
    conn = sub.add_parser("connector", help="the KV push connector").add_subparsers(dest="conn_cmd")
    k = conn.add_parser(
        "keys", help="make CURVE key pairs for the control channel",
        description="Without --name: a prefill and a decode key pair in DIR, each trusted by the other "
                    "(trusted-by-prefill/, trusted-by-decode/), and prints the connector knobs per role "
                    "(p, d). With --name: one pair, NAME.key (public) and NAME.key_secret; copy NAME.key "
                    "into the trust directory of each peer that should accept it.")
    k.add_argument("dir", help="where the key files go (created 0700)")
    k.add_argument("--name", help="make one key pair with this name instead of a prefill/decode set")
    k.set_defaults(func=_cmd_keys)
    return conn
