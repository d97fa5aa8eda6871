"""The `mambaserve` command: `generate`, `serve`, `bench latency|throughput|serve`.

Each subcommand lives in its own module and registers itself here through a `register(sub)`
function, so this file only dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# the optional extra each subcommand needs beyond the core install
_EXTRAS = {"serve": "server"}

# subcommand -> module providing register(subparsers)
_SUBCOMMANDS = {
    "generate": "mambaserve.entrypoints.generate",
    "serve": "mambaserve.entrypoints.server",
    "bench": "mambaserve.entrypoints.bench",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mambaserve", description="Serve Mamba2 and hybrid SSM language models.")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in _SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            # an optional extra is missing: keep the command visible, explain on use
            hint = f'pip install "mambaserve[{_EXTRAS.get(name, name)}]"'
            p = sub.add_parser(name, help=f"(unavailable: {hint})", add_help=False)
            p.set_defaults(unavailable=True, func=lambda args, e=e, hint=hint: sys.exit(
                f"mambaserve: this command needs an optional dependency ({e}); install it with: {hint}"))
            continue
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "unavailable", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except ValueError as e:
        print(f"mambaserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
