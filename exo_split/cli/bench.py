"""`exo-split bench`: the overlap benchmark between two network namespaces (root, Linux);
`--multiturn`: prefix reuse over a conversation, on loopback (bench/multiturn.py); `--vllm`:
the vllm prefill node beside the torch one (bench/vllm.py)."""

from __future__ import annotations

import argparse


def add_bench(subparsers) -> None:
    from exo_split.bench import run as bench

    p = subparsers.add_parser(
        "bench",
        help="benchmark the overlapped handoff between two network namespaces (root, Linux)",
        description=bench.__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_arguments(p)
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    if args.vllm:
        from exo_split.bench import vllm
        from exo_split.cli.common import model_dir

        args.model = model_dir(str(args.model or "smollm2"))  # the embedded SmolLM2 by default
        return vllm.main(args)
    if args.multiturn:
        from exo_split.bench import multiturn

        return multiturn.main(args)
    from exo_split.bench import run as bench

    return bench.main(args)
