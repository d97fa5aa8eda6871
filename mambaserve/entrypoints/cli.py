"""The `mambaserve` command: `generate`, `serve`, `bench latency|throughput|serve`.

Each subcommand lives in its own module and registers itself here through a `register(sub)`
function, so this file only dispatches, and does what vLLM's command does for every
subcommand: `--version`; `--log-level` before or after the subcommand (default INFO, as
vLLM's); `--config FILE.yaml`, a YAML mapping of flag names (dashes or underscores) to values,
read as if its flags came first on the command line, so that flags given there win; an
argument error printed with the subcommand's usage.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys

from mambaserve import __version__

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
    parser.add_argument("--version", action="version", version=f"mambaserve {__version__}")
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=["CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG"])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in _SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            # an optional extra is missing: keep the command visible, explain on use
            hint = f'pip install "mambaserve[{_EXTRAS.get(name, name)}]"'
            p = sub.add_parser(name, help=f"(unavailable: {hint})", add_help=False)
            p.add_argument("rest", nargs=argparse.REMAINDER)
            p.set_defaults(unavailable=True, func=lambda args, e=e, hint=hint: sys.exit(
                f"mambaserve: this command needs an optional dependency ({e}); install it with: {hint}"))
            continue
        mod.register(sub)
    for leaf in _leaves(parser):
        # no prefix matching: `--prompt x` must not read a file named x through --prompts-file
        leaf.allow_abbrev = False
        if "--log-level" not in leaf._option_string_actions and "rest" not in {a.dest for a in leaf._actions}:
            leaf.add_argument("--log-level", default=argparse.SUPPRESS, type=str.upper,
                              choices=["CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG"],
                              help="logging level (also accepted before the subcommand; default INFO)")
    return parser


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def _leaves(parser: argparse.ArgumentParser):
    """Every parser that takes a command's own flags (generate, serve, bench latency, ...)."""
    children = _subparsers(parser)
    if not children:
        yield parser
    for child in children.values():
        yield from _leaves(child)


def expand_config(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """argv with `--config FILE` replaced by the flags of the YAML mapping in FILE, placed right
    after the subcommand (and its positional model, if any) so that flags on the command line
    come later and win. true is the flag itself, false its --no- form where there is one (else
    nothing), a list the values of a many-valued flag (else JSON), a mapping JSON. Raises
    ValueError for an unreadable file, a key that is no flag of the subcommand, or no subcommand."""
    if not any(a == "--config" or a.startswith("--config=") for a in argv):
        return argv
    argv, files = list(argv), []
    while True:
        i = next((k for k, a in enumerate(argv) if a == "--config" or a.startswith("--config=")), None)
        if i is None:
            break
        if argv[i] == "--config":
            if i + 1 >= len(argv):
                raise ValueError("--config needs a YAML file")
            files.append(argv[i + 1])
            del argv[i:i + 2]
        else:
            files.append(argv[i].split("=", 1)[1])
            del argv[i]
    at, leaf = 0, parser
    while _subparsers(leaf):
        names = _subparsers(leaf)
        at = next((k for k in range(at, len(argv)) if argv[k] in names), None)
        if at is None:
            raise ValueError("--config needs a subcommand (e.g. mambaserve serve --config FILE.yaml)")
        leaf, at = names[argv[at]], at + 1
    if at < len(argv) and not argv[at].startswith("-"):
        at += 1  # the positional model of `serve MODEL`
    flags = []
    for path in files:
        flags += _config_flags(leaf, path)
    return argv[:at] + flags + argv[at:]


def _config_flags(leaf: argparse.ArgumentParser, path: str) -> list[str]:
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"could not read --config {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    flags = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if flag == "--model-tag":
            flag = "--model"
        action = leaf._option_string_actions.get(flag)
        if action is None:
            raise ValueError(f"--config {path}: {key!r} is not a flag of this command")
        if isinstance(value, bool):
            no = "--no-" + flag[2:]
            flags += [flag] if value and action.nargs == 0 else [no] if no in leaf._option_string_actions else []
            if value and action.nargs != 0:
                flags += [flag, str(value).lower()]
        elif isinstance(value, list) and action.nargs in ("+", "*"):
            flags += [flag] + [str(v) for v in value]
        elif isinstance(value, (list, dict)):
            flags += [flag, json.dumps(value)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = expand_config(parser, argv)
    except ValueError as e:
        parser.error(str(e))
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said with the usage of the subcommand they were given to, not the top level's
        leaf = _subparsers(parser)[args.command]
        if getattr(args, "bench_command", None):
            leaf = _subparsers(leaf)[args.bench_command]
        leaf.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except ValueError as e:
        print(f"mambaserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
