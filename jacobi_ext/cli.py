"""The `jacobi-forcing` command line.

Each subcommand lives next to the code it drives and is registered here; heavy imports (torch
models, transformers) happen inside the handlers so `jacobi-forcing --help` stays instant.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

Handler = Callable[[argparse.Namespace], int]


def _cmd_info(args: argparse.Namespace) -> int:
    import jacobi_ext

    info = jacobi_ext.build_info()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(len(k) for k in info)
        for k, v in info.items():
            print(f"{k:<{width}}  {v}")
    return 0


def _add_info(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="show how jacobi_ext was built and what it runs on")
    p.add_argument("--json", action="store_true", help="print as JSON")
    p.set_defaults(handler=_cmd_info)


# Subcommand registrars, in the order `--help` lists them.
REGISTRARS: list[Callable[[argparse._SubParsersAction], None]] = [_add_info]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jacobi-forcing",
        description="Jacobi Forcing: decode autoregressive LLMs several times faster with the "
        "same greedy output.",
    )
    from jacobi_ext._version import __version__

    parser.add_argument("--version", action="version", version=f"jacobi_ext {__version__}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    for register in REGISTRARS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        return handler(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
