"""The ``kvpath`` command line."""

from __future__ import annotations

import argparse
import logging
import sys

from kvpath import __version__


def _cmd_model_tiny(args: argparse.Namespace) -> int:
    from kvpath.tiny_model import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(
        layers=args.layers, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
        intermediate=args.intermediate, vocab=args.vocab, max_positions=args.max_positions, seed=args.seed,
        dtype=args.dtype,
    )
    try:
        spec.validate()
    except ValueError as e:
        raise SystemExit(f"kvpath model tiny: error: {e}") from None
    out = build_tiny_model(args.out, spec)
    print(out)
    return 0


def _cmd_connector_demo(args: argparse.Namespace) -> int:
    from kvpath.demo import run_demo

    return run_demo(
        workdir=args.workdir, n_requests=args.requests, max_tokens=args.max_tokens, lanes=args.lanes,
        base_port=args.base_port,
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpath", description=__doc__)
    p.add_argument("--version", action="version", version=f"kvpath {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command")

    model = sub.add_parser("model", help="local models for tests and demos").add_subparsers(dest="model_cmd")
    t = model.add_parser("tiny", help="write a tiny random-weight Llama and a locally trained tokenizer")
    t.add_argument("--out", required=True, help="output directory")
    t.add_argument("--layers", type=int, default=2)
    t.add_argument("--heads", type=int, default=4)
    t.add_argument("--kv-heads", type=int, default=2)
    t.add_argument("--head-dim", type=int, default=64, help="vLLM CPU attention needs 32, 64, 80, ... (not 16)")
    t.add_argument("--intermediate", type=int, default=512)
    t.add_argument("--vocab", type=int, default=1024)
    t.add_argument("--max-positions", type=int, default=4096)
    t.add_argument("--dtype", default="float32")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=_cmd_model_tiny)

    conn = sub.add_parser("connector", help="the KV push connector").add_subparsers(dest="conn_cmd")
    d = conn.add_parser("demo", help="tiny model + P and D vllm servers with KVPathConnector + a P-then-D client")
    d.add_argument("--workdir", default="runs/connector-demo", help="model, logs and trace go here")
    d.add_argument("--requests", type=int, default=8)
    d.add_argument("--max-tokens", type=int, default=16)
    d.add_argument("--lanes", type=int, default=4)
    d.add_argument("--base-port", type=int, default=8100)
    d.set_defaults(func=_cmd_connector_demo)

    from kvpath.proxy.cli import add_parsers
    from kvpath.bridge.cli import add_parsers as add_bridge_parsers
    from kvpath.testbed.cli import add_parsers as add_testbed_parsers

    add_parsers(sub)
    add_testbed_parsers(sub)
    add_bridge_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
