"""`exo-split convert-gguf`: a GGUF file (llama.cpp, Ollama, LM Studio) into a Hugging Face
checkpoint directory that both nodes load (models/gguf.py does the work)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from exo_split.cli.common import conversion_progress, say


def add_convert_gguf(subparsers) -> None:
    p = subparsers.add_parser(
        "convert-gguf",
        help="convert a Llama/Mistral/Qwen2/Qwen3 (MoE)/Gemma 3/gpt-oss GGUF file into a "
        "checkpoint directory",
        description="Write config.json, model.safetensors, tokenizer.json, tokenizer_config.json "
        "(with the chat template) and generation_config.json (the end-of-turn ids) for a GGUF "
        "file. Quantized weights are dequantized: both nodes run the same full-precision "
        "numbers (gpt-oss's MXFP4 experts are repacked as OpenAI publishes them, the same "
        "numbers). Needs no torch, so the Mac can convert too.",
    )
    p.add_argument("gguf", type=Path, metavar="FILE.gguf", help="the GGUF file")
    p.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="the directory to write")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="weight dtype of the checkpoint (default float32)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it holds something")
    p.set_defaults(func=cmd_convert_gguf)


def cmd_convert_gguf(args: argparse.Namespace) -> int:
    from exo_split.models.gguf import convert_gguf

    t0 = time.perf_counter()
    with conversion_progress() as progress:
        out = convert_gguf(
            args.gguf, args.out_dir, dtype=args.dtype, progress=progress, overwrite=args.overwrite
        )
    say(f"converted in {time.perf_counter() - t0:.1f} s; use it with --model {out}")
    return 0
