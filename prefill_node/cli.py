"""`prefill-node` command: an OpenAI-compatible prefill node (see engine.server.node_main)."""

from __future__ import annotations

import sys

from engine.server.node_main import run_node


def main(argv: list[str] | None = None) -> None:
    sys.exit(run_node("prefill", argv))


if __name__ == "__main__":
    main()
