"""``pd-bench``: measure pdserve.

    pd-bench offline --workload throughput --model DIR --device cuda --compare-hf
    pd-bench serve --base-url http://127.0.0.1:8000 --num-prompts 64 --max-concurrency 32
    pd-bench make-model --out /tmp/llama-886m --preset llama-886m
    pd-bench transfer --tokens 128 512 2048 8192 --tp 1 2 --json transfer.json --plot t.png
    pd-bench interference --smoke --json interference.json --plot interference.png

Each subcommand imports what it needs only when it runs: ``serve`` never imports torch.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from engine.bench.interference import add_interference_args
    from engine.bench.models import add_make_model_args
    from engine.bench.offline import add_offline_args
    from engine.bench.serve_args import add_serve_args
    from engine.bench.transfer import add_transfer_args

    parser = argparse.ArgumentParser(
        prog="pd-bench", description="pdserve benchmarks", allow_abbrev=False
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    offline = sub.add_parser(
        "offline",
        allow_abbrev=False,
        help="engine throughput/latency without HTTP (engine.llm.LLM)",
    )
    add_offline_args(offline)
    offline.set_defaults(_parser=offline)
    serve = sub.add_parser(
        "serve",
        allow_abbrev=False,
        help="load an OpenAI endpoint (node or pd-proxy), like `vllm bench serve`",
    )
    add_serve_args(serve)
    serve.set_defaults(_parser=serve)
    make = sub.add_parser(
        "make-model",
        allow_abbrev=False,
        help="write a random HF Llama/Qwen2 checkpoint for benchmarks",
    )
    add_make_model_args(make)
    make.set_defaults(_parser=make)
    transfer = sub.add_parser(
        "transfer",
        allow_abbrev=False,
        help="KV push P->D: the NIXL connector path vs raw NIXL vs a local copy, same bytes",
    )
    add_transfer_args(transfer)
    transfer.set_defaults(_parser=transfer)
    interference = sub.add_parser(
        "interference",
        allow_abbrev=False,
        help="1 P + 1 D vs 2 colocated nodes behind pd-proxy, long prompts arriving over "
        "ongoing decodes: ITL, TTFT, goodput and their ratios (DistServe's experiment)",
    )
    add_interference_args(interference)
    interference.set_defaults(_parser=interference)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, sub = _parse(parser, argv)
    try:
        return _run(args, sub)
    except KeyboardInterrupt:  # Ctrl-C: the subcommands' finally blocks have run
        print(f"pd-bench {args.command}: interrupted", file=sys.stderr)
        return 130


def _parse(
    parser: argparse.ArgumentParser, argv: list[str] | None
) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    args, extra = parser.parse_known_args(argv)
    sub = args._parser
    if extra:  # the subcommand's usage, not pd-bench's (argparse gives the top-level one)
        sub.error(f"unrecognized arguments: {' '.join(extra)}")
    del args._parser
    return args, sub


def _run(args: argparse.Namespace, sub: argparse.ArgumentParser) -> int:
    if args.command == "offline":
        from engine.bench.offline import run_offline

        return run_offline(args, sub)
    if args.command == "serve":
        from engine.bench.serve import run_serve

        return run_serve(args, sub)
    if args.command == "transfer":
        from engine.bench.transfer import run_transfer

        return run_transfer(args, sub)
    if args.command == "interference":
        from engine.bench.interference import run_interference

        return run_interference(args, sub)
    from engine.bench.models import run_make_model

    return run_make_model(args)


if __name__ == "__main__":
    sys.exit(main())
