"""`exo-split node`: a node agent for one model, served until Ctrl-C / SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

from exo_split.cli.common import add_token_option, model_dir, say, seconds, size
from exo_split.cli.discover import add_discovery_options, interfaces, static_peers
from exo_split.errors import ExoSplitError
from exo_split.node.slicing import LOCAL_SLICE, SLICE_S, Slicing

DEFAULT_PORT = 52417


def add_node(subparsers) -> None:
    p = subparsers.add_parser(
        "node",
        help="run a node agent (prefill and/or decode) for one model",
        description="Load a model into one backend and serve it to peers over HTTP.",
    )
    p.add_argument(
        "--model",
        required=True,
        type=model_dir,
        help="Hugging Face checkpoint directory, or an embedded model (smollm2, gemma3)",
    )
    p.add_argument("--backend", required=True, choices=("torch", "mlx", "vllm"))
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="vllm: one of vLLM's engine arguments (VALUE read as JSON, else a string), e.g. "
        "max_num_batched_tokens=4096, quantization=fp8, gpu_memory_utilization=0.8; repeatable",
    )
    p.add_argument("--device", help="torch: cpu or cuda[:N] (default: cuda if present); mlx: cpu")
    p.add_argument(
        "--dtype",
        choices=("float32", "float16", "bfloat16"),
        help="compute dtype (default float32; a quantized checkpoint: the dtype of its scales)",
    )
    p.add_argument(
        "--host",
        default="0.0.0.0",
        help="address to listen on (default 0.0.0.0: all, so peers can reach it; every "
        "request needs the token)",
    )
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (0: any free port)")
    p.add_argument(
        "--insecure-transport",
        action="store_true",
        help="node-to-node traffic (prompts, KV) in cleartext: ask peers over plain TCP and "
        "serve /v1/prefill without TLS; only on a cable or network you trust (default: TLS, "
        "each node's certificate pinned through the token)",
    )
    add_discovery_options(p, timeout=False)
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="do not measure prefill/decode speed at start-up (advertise none unless cached)",
    )
    p.add_argument("--remeasure", action="store_true", help="measure speeds even if cached")
    p.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="leave the objects made at start-up to Python's cyclic garbage collector (by "
        "default they are frozen once the node is ready: a full collection of them takes "
        "~150 ms, a stall every stream of the node would see)",
    )
    p.add_argument(
        "--local-slice",
        type=int,
        default=LOCAL_SLICE,
        metavar="TOKENS",
        help="a prompt this node prefills itself runs in jobs of at most this many positions, "
        f"the batch taking a decode step between two (default {LOCAL_SLICE})",
    )
    p.add_argument(
        "--local-slice-ms",
        type=float,
        default=SLICE_S * 1000,
        metavar="MS",
        help="while other requests decode, such a job is sized to about this long at the "
        "node's measured prefill speed (at least 32 positions), so their next token waits at "
        f"most about that; 0: always --local-slice (default {SLICE_S * 1000:g})",
    )
    p.add_argument(
        "--model-name",
        metavar="NAME",
        help="the model's id in the OpenAI API (default: the checkpoint directory's name)",
    )
    add_token_option(p)
    add_limit_options(p)
    p.add_argument("--ready-file", type=Path, help="write the node's info as JSON here when ready")
    p.set_defaults(func=cmd_node)


def add_limit_options(p: argparse.ArgumentParser) -> None:
    """Limits and timeouts of a node (docs/reliability.md has what each one bounds)."""
    from exo_split.transport.limits import Limits

    g = p.add_argument_group("limits and timeouts (docs/reliability.md)")
    g.add_argument("--max-prompt-tokens", type=int, default=32_768)
    g.add_argument(
        "--max-concurrent",
        type=int,
        default=Limits.max_concurrent,
        help="requests of each kind in progress at once",
    )
    g.add_argument(
        "--max-kv-bytes",
        type=size,
        default="8G",
        metavar="SIZE",
        help="KV held for requests in progress, e.g. 512M, 8G (default 8G)",
    )
    g.add_argument(
        "--max-frame-bytes",
        type=size,
        default="16M",
        metavar="SIZE",
        help="the largest KV frame this node sends or accepts; a bigger layer travels as "
        "several token ranges (default 16M)",
    )
    g.add_argument(
        "--max-inflight-bytes",
        type=size,
        default="64M",
        metavar="SIZE",
        help="prefill: KV handed to the sender and not yet on the wire; the prefill waits "
        "beyond it (default 64M)",
    )
    for flag, default, what in (
        ("--connect-timeout", 5.0, "connecting to a peer"),
        ("--first-frame-timeout", 30.0, "a prefill peer's first frame"),
        ("--idle-timeout", 60.0, "the longest silence within a stream"),
        ("--prefill-timeout", 600.0, "a whole remote prefill"),
    ):
        g.add_argument(flag, type=seconds, default=default, metavar="S", help=f"{what} (s)")
    g.add_argument(
        "--header-timeout",
        type=seconds,
        default=10.0,
        metavar="S",
        help="a new connection's time to send a whole HTTP request head or its KV ticket; "
        "at most 32 such connections per address wait at once (default 10 s)",
    )
    g.add_argument(
        "--staging-bytes",
        type=size,
        metavar="SIZE",
        help="torch on CUDA: pinned host memory for the KV on its way to the network, "
        "allocated once at start-up (default 64M, in 4 slots)",
    )
    g.add_argument(
        "--prefix-cache-bytes",
        type=lambda text: size(text, zero=True),
        default="2G",
        metavar="SIZE",
        help="KV of finished requests kept for reuse by the next turn (prefix cache, LRU), "
        "counted in --max-kv-bytes and given up before a request is refused; 0: off "
        "(default 2G)",
    )
    g.add_argument(
        "--keys-file",
        type=Path,
        metavar="FILE",
        help="clients' API keys (exo-split keys add NAME), each with a prefix cache of its own; "
        "re-read when it changes (default ~/.config/exo-split/keys.json if it exists)",
    )
    g.add_argument(
        "--busy-wait",
        type=lambda text: seconds(text, zero=True),
        default=0.0,
        metavar="S",
        help="how long to keep asking a busy (503) prefill peer before prefilling locally",
    )


ENGINE_ARGS_ENV = "EXO_SPLIT_VLLM_ARGS"  # backends/vllm_backend.py reads it


def engine_args(pairs: list[str]) -> dict:
    """--engine-arg KEY=VALUE pairs as vLLM's keyword arguments (VALUE: JSON, else text)."""
    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key.strip():
            raise ExoSplitError(f"--engine-arg {pair!r}: expected KEY=VALUE")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def cmd_node(args) -> int:
    from exo_split.node.agent import Node, NodeConfig
    from exo_split.node.capabilities import default_cache_dir
    from exo_split.transport.auth import copy_instructions, default_token_file, resolve_token
    from exo_split.transport.client import Timeouts
    from exo_split.transport.heads import even_ranges
    from exo_split.transport.keys import default_keys_file
    from exo_split.transport.limits import Limits
    from exo_split.transport.tls import load_identity

    token, source = resolve_token(args.token_file, dict(os.environ), create=True)
    if source.endswith("(new)"):
        say(copy_instructions(Path(source.removesuffix(" (new)"))))
    identity, made = load_identity((args.token_file or default_token_file()).parent)
    say(
        f"TLS certificate {identity.cert_path} ({'new, ' if made else ''}sha256 "
        f"{identity.fingerprint[:16]}...); node-to-node traffic "
        + ("in cleartext (--insecure-transport)" if args.insecure_transport else "encrypted")
    )
    if args.engine_arg:
        if args.backend != "vllm":
            raise ExoSplitError("--engine-arg is for --backend vllm")
        os.environ[ENGINE_ARGS_ENV] = json.dumps(engine_args(args.engine_arg))
    # Test hook (docs/reliability.md): SIGKILL the node once it has sent layer k.
    die_after = os.environ.get("EXO_SPLIT_TEST_DIE_AFTER_LAYER")
    config = NodeConfig(
        model_dir=Path(args.model),
        backend=args.backend,
        token=token,
        device=args.device,
        dtype=args.dtype,
        host=args.host,
        port=args.port,
        peers=tuple(str(a) for a in static_peers(args)),
        mdns=not args.no_mdns,
        interfaces=tuple(interfaces(args) or ()),
        cache_dir=default_cache_dir(os.environ),
        warmup=not args.no_warmup,
        remeasure=args.remeasure,
        gc_freeze=not args.no_gc_freeze,
        slicing=slicing(args.local_slice, args.local_slice_ms),
        limits=Limits(
            max_prompt_tokens=args.max_prompt_tokens,
            max_concurrent=args.max_concurrent,
            max_kv_bytes=args.max_kv_bytes,
            max_frame_bytes=args.max_frame_bytes,
            max_inflight_bytes=args.max_inflight_bytes,
        ),
        timeouts=Timeouts(
            connect=args.connect_timeout,
            first_frame=args.first_frame_timeout,
            idle=args.idle_timeout,
            total=args.prefill_timeout,
            busy_wait=args.busy_wait,
        ),
        ready_file=args.ready_file,
        model_name=args.model_name,
        die_after_layer=int(die_after) if die_after else None,
        staging_bytes=args.staging_bytes,
        prefix_cache_bytes=args.prefix_cache_bytes,
        header_timeout=args.header_timeout,
        keys_file=args.keys_file or default_keys_file(),
        identity=identity,
        insecure_transport=args.insecure_transport,
    )
    node = Node(config, progress=say)
    # Test hook (docs/vllm.md): each layer's frames as N head ranges, as the workers of a
    # tensor-parallel prefill engine hold them.
    if parts := os.environ.get("EXO_SPLIT_TEST_HEAD_RANGES"):
        node.backend.head_ranges = even_ranges(node.spec.n_kv_heads, int(parts))
    asyncio.run(node.serve())
    return 0


def slicing(tokens: int, ms: float) -> Slicing:
    try:
        return Slicing(max_tokens=tokens, target_s=ms / 1000)
    except ValueError:
        raise ExoSplitError(f"--local-slice must be >= 1 and --local-slice-ms >= 0 (got "
                            f"{tokens} and {ms:g})") from None  # fmt: skip
