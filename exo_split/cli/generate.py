"""`exo-split generate`: prefill on one backend, decode on another, in this process."""

from __future__ import annotations

import json
import time
from typing import Any

from exo_split.backends import BACKENDS, Backend, load_backend
from exo_split.cli.common import (
    UsageError,
    add_model_options,
    add_prompt_options,
    out,
    positive_int,
    read_prompt,
    say,
)
from exo_split.handoff import SplitResult, split_generate
from exo_split.sampling import Sampling
from exo_split.spec import ModelSpec, check_request, load_spec
from exo_split.tokenizer import TextCodec, TextStream


def load_verbose(name: str, model_dir: str, dtype: str, device: str | None) -> Backend:
    say(f"loading {name} backend ({dtype}) from {model_dir} ...")
    t0 = time.perf_counter()
    # --device names a torch device (cpu, cuda, cuda:1); "cpu" also puts mlx on the CPU.
    dev = device if name == "torch" or device == "cpu" else None
    backend = load_backend(name, model_dir, dtype=dtype, device=dev)
    say(f"{name} backend ready on {backend.device} in {time.perf_counter() - t0:.2f} s")
    return backend


def add_generate(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="prefill on one backend, decode on another, in this process",
        description="Generate text with the prefill on one backend and the decode on another "
        "(the same backend for both is the local baseline). The KV cache is handed over in "
        "process, layer by layer.",
    )
    add_model_options(p)
    p.add_argument("--prefill-backend", choices=BACKENDS, default="torch")
    p.add_argument("--decode-backend", choices=BACKENDS, default="mlx")
    add_prompt_options(p)
    p.add_argument("--max-tokens", type=positive_int, default=64, metavar="N", help="default 64")
    p.add_argument(
        "--device", help="torch device (cpu, cuda, cuda:1); 'cpu' also puts mlx on the CPU"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (with --temperature)")
    p.add_argument(
        "--prefill-chunk", type=positive_int, metavar="C", help="prefill C tokens at a time"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (last line of stdout) instead of streaming text",
    )
    p.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    try:
        sampling = Sampling.from_dict({"temperature": args.temperature, "seed": args.seed})
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    prompt = read_prompt(args)
    # Fail fast, before loading anything heavy: checkpoint, tokenizer, context length.
    spec = load_spec(args.model)
    codec = TextCodec(args.model)
    ids = codec.tokenize(prompt)
    check_request(spec, len(ids), args.max_tokens)

    prefill = load_verbose(args.prefill_backend, args.model, args.dtype, args.device)
    decode = prefill
    if args.decode_backend != args.prefill_backend:
        decode = load_verbose(args.decode_backend, args.model, args.dtype, args.device)

    stream = TextStream(codec)
    on_token = None
    if not args.json:

        def on_token(token: int) -> None:
            out(stream.push(token))

    result = split_generate(
        prefill,
        decode,
        ids,
        max_tokens=args.max_tokens,
        sampling=sampling,
        chunk=args.prefill_chunk,
        stop_ids=codec.eos_ids,
        on_token=on_token,
    )
    text = codec.detokenize(result.tokens)
    if args.json:
        finished = "eos" if result.tokens[-1] in codec.eos_ids else "max_tokens"
        doc = _generate_doc(result, text, spec, prefill, decode, sampling, finished)
        print(json.dumps(doc))
    else:
        out(stream.finish(text) + "\n")  # a held-back partial character, if any
    say(_generate_summary(result, prefill.name, decode.name))
    return 0


def _generate_doc(
    result: SplitResult,
    text: str,
    spec: ModelSpec,
    prefill: Backend,
    decode: Backend,
    sampling: Sampling,
    finish_reason: str,
) -> dict[str, Any]:
    return {
        "tokens": result.tokens,
        "text": text,
        "prompt_tokens": result.prompt_tokens,
        "prefill_backend": prefill.name,
        "decode_backend": decode.name,
        "dtype": decode.dtype,
        "devices": {"prefill": prefill.device, "decode": decode.device},
        "model": spec.name,
        "fingerprint": spec.fingerprint,
        "sampling": sampling.to_dict(),
        "finish_reason": finish_reason,
        "timings": result.timings,
    }


def _generate_summary(result: SplitResult, prefill: str, decode: str) -> str:
    t = result.timings
    n_decode = len(result.tokens) - 1
    return (
        f"prompt {result.prompt_tokens} tokens | prefill ({prefill}) {t['prefill_s']:.3f} s, "
        f"{t['prefill_tokens_per_s']:.0f} tok/s | TTFT {t['ttft_s']:.3f} s | "
        f"decode ({decode}) {n_decode} tokens, {t['decode_tokens_per_s']:.1f} tok/s"
    )
