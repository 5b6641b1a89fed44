"""The launcher's sglang side: help, argument preparation and serving."""

from __future__ import annotations

import argparse
import os


def print_help(prog: str, add_spec_args) -> None:
    """sglang's flags, then the ``sgl_spec options`` group."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(
        prog=prog,
        description="Launch an SGLang server with sgl_spec's cache and attention "
        "backends. Accepts every sglang.launch_server flag plus the --spec-* flags.",
    )
    ServerArgs.add_cli_args(parser)
    add_spec_args(parser)
    parser.print_help()


def serve(argv: list[str], add_route: bool) -> None:
    """Run sglang's server on ``argv`` (sglang flags only); ``add_route``: serve
    ``GET /sgl_spec/cache`` too."""
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(argv)
    if add_route:
        from .endpoint import add_route as add

        add()
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
