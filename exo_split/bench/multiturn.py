"""`exo-split bench --multiturn`: does a later turn of a conversation cost only its new tokens?

A five-turn conversation (bench/conversation.py) through a prefill node (torch) and a decode
node (MLX) on 127.0.0.1, each pinned to its own core. Both measure their speeds at start, so
the decode node's policy chooses where each turn is prefilled. Every turn runs twice on the
same history (the replies of the runs with reuse), in alternating order: with prefix reuse
(the nodes' default) and without it (`prefix_cache: false`: neither node reuses or keeps
anything). Per run: the client's TTFT, where the prefill ran and why, the KV bytes moved and
the prompt positions they covered, the tokens each node held already, the tokens computed,
and whether both runs generated the same tokens (float32, greedy: they must).

Acceptance (issue 13): turns >= 2 reach a TTFT <= 0.25 x turn 1's and <= 0.25 x the same turn
without reuse, and move only the new tokens' KV: none when prefilled on the decode node, else
exactly the positions from what the decode node held to the end of the prompt.

A card on stdout, then one JSON line (`"schema": "exo-split.bench-multiturn/1"`). No root
needed. --quick: a tiny checkpoint with a chat template and short turns, for the test.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from exo_split.bench import conversation
from exo_split.bench.lab import BenchError, Lab
from exo_split.report.turn import moved_range, prefilled_where, prefix_of

SCHEMA = "exo-split.bench-multiturn/1"
TARGET_RATIO = 0.25  # turns >= 2: TTFT against turn 1's, and against the same turn without reuse


def request(
    lab: Lab, messages: list[dict], max_tokens: int, *, reuse: bool, prefill: str = "auto"
) -> dict[str, Any]:
    """One turn through the decode node; what it cost, read from its report."""
    # The prefill peer is not named: the decode node knows it (--peer) and its policy chooses.
    body = {"messages": messages, "max_tokens": max_tokens, "sampling": {"temperature": 0.0},
            "prefill": prefill, "fallback": "none"}  # fmt: skip
    if not reuse:
        body["prefix_cache"] = False
    out = lab.call({"op": "generate", "url": lab.decode_url, "body": body})
    report = out["report"]
    moved, decision = moved_range(report), report.get("decision") or {}
    return {
        "ttft_s": out["client_ttft_s"],
        "prompt_tokens": report["prompt_tokens"],
        "generated_tokens": len(out["tokens"]),
        "prefill": prefilled_where(report),
        "decision": decision.get("reason"),
        "estimates": decision.get("estimates"),  # the policy's TTFT estimates, local and remote
        "break_even_tokens": decision.get("break_even_tokens"),
        "kv_bytes": report.get("kv_bytes"),
        "moved": list(moved) if moved else None,
        "prefix": prefix_of(report),
        "tokens": out["tokens"],
        "text": out["text"],
    }


def only_new_kv(run: dict, reusable: int) -> bool | None:
    """Whether a run moved only the KV the decode node lacked: nothing after a local prefill,
    else exactly [decode_cached_tokens, prompt) with all of the reusable history held (less
    the last reply token, whose KV exists only once it is fed back in). None: the node
    reports no prefix figures."""
    held = run["prefix"]["decode_cached_tokens"]
    if run["prefill"] != "remote":
        return run["kv_bytes"] == 0
    if held is None:
        return None
    return run["moved"] == [held, run["prompt_tokens"]] and held >= reusable - 1


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def converse(
    lab: Lab, conv: conversation.Conversation, max_tokens: int, progress, *, later: str = "auto"
) -> list[dict]:
    """The conversation, each turn with and without reuse; one row per turn. `later`: where
    turns >= 2 with reuse are prefilled (auto: as the policy chooses)."""
    from exo_split.chat import ChatTemplate

    template = ChatTemplate(lab.model)  # what the decode node renders, to count reusable tokens
    history = [{"role": "system", "content": conv.system}]
    rows: list[dict] = []
    held: list[int] = []  # the last turn's prompt and reply tokens: what reuse could keep
    for k, user in enumerate(conv.turns, 1):
        messages = [*history, {"role": "user", "content": user}]
        ids = template.token_ids(messages)
        runs = {}
        for reuse in (True, False) if k % 2 else (False, True):  # drift hits both alike
            where = later if reuse and k > 1 else "auto"
            runs[reuse] = request(lab, messages, max_tokens, reuse=reuse, prefill=where)
        with_, without = runs[True], runs[False]
        if with_["prompt_tokens"] != len(ids):
            raise BenchError(f"turn {k}: the decode node's prompt has {with_['prompt_tokens']} "
                             f"tokens, the chat template here gives {len(ids)}")  # fmt: skip
        reusable = common_prefix(held, ids)
        rows.append({
            "turn": k,
            "prompt_tokens": len(ids),
            "history_tokens": len(held),  # the last turn's prompt and reply
            "reusable_tokens": reusable,  # of those, the start of this prompt
            "new_tokens": len(ids) - reusable,
            "reuse": with_,
            "no_reuse": without,
            "same_tokens": with_["tokens"] == without["tokens"],
            "only_new_kv": only_new_kv(with_, reusable),
        })  # fmt: skip
        history = [*messages, {"role": "assistant", "content": with_["text"]}]
        held = ids + with_["tokens"]
        progress(
            f"turn {k}: {len(ids):,} tokens ({len(ids) - reusable:,} new), TTFT "
            f"{with_['ttft_s'] * 1e3:,.0f} ms ({with_['prefill']}) with reuse, "
            f"{without['ttft_s'] * 1e3:,.0f} ms ({without['prefill']}) without"
        )
    return rows


def summarize(rows: list[dict]) -> dict[str, Any]:
    """The ratios per turn and the acceptance over turns >= 2."""
    first = rows[0]["reuse"]["ttft_s"]
    for r in rows:
        ttft = r["reuse"]["ttft_s"]
        r["ttft_vs_turn1"] = ttft / first
        r["ttft_vs_no_reuse"] = ttft / r["no_reuse"]["ttft_s"]
    later = rows[1:]

    def target(key: str) -> dict:
        worst = max((r[key] for r in later), default=None)
        return {"worst": worst, "met": None if worst is None else worst <= TARGET_RATIO,
                "turns_met": sum(r[key] <= TARGET_RATIO for r in later), "of": len(later)}  # fmt: skip

    checks = [r["only_new_kv"] for r in later]
    met = False if False in checks else None if None in checks or not checks else True
    return {
        "ttft_vs_turn1": target("ttft_vs_turn1"),
        "ttft_vs_no_reuse": target("ttft_vs_no_reuse"),
        "only_new_kv": {"met": met, "turns_met": checks.count(True), "of": len(checks)},
        "same_tokens": all(r["same_tokens"] for r in rows),
    }


# ---- the card ------------------------------------------------------------------------------


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:,.0f}"


def _n(x: int | None) -> str:
    return "?" if x is None else f"{x:,}"


def _mb(x: int | None) -> str:
    return "?" if x is None else f"{x / 1e6:,.2f}"


def render_card(doc: dict, *, width: int = 120) -> str:
    from rich import box
    from rich.table import Table

    from exo_split.report.text import render_rich

    header = [
        f"exo-split bench --multiturn · {Path(doc['model']).name} · torch prefill → mlx decode "
        f"on 127.0.0.1 · greedy · {doc['max_tokens']} reply tokens at most",
        f"cpus: {doc['cpus'] or 'not pinned'} · each turn with and without prefix reuse, same "
        f"history · load average {doc['load_average']['start'][0]:.1f} at the start, "
        f"{doc['load_average']['end'][0]:.1f} at the end (1 min)",
    ]
    if doc["suffix_prefill"] != "auto":
        header.append(f"turns ≥ 2 with reuse prefilled {doc['suffix_prefill']} (asked for)")
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    for col in ("turn", "prompt", "new", "prefill", "TTFT", "no reuse", "prefill ", "/turn 1",
                "/no reuse", "KV MB", "no reuse ", "moved", "held dec", "held pre", "computed",
                "only new", "same"):  # fmt: skip
        table.add_column(col, justify="right", no_wrap=True)
    yes = {True: "yes", False: "NO", None: "?"}
    for r in doc["turns"]:
        a, b, p = r["reuse"], r["no_reuse"], r["reuse"]["prefix"]
        moved = "—" if a["moved"] is None else f"{a['moved'][0]:,}-{a['moved'][1]:,}"
        table.add_row(
            str(r["turn"]), f"{r['prompt_tokens']:,}", f"{r['new_tokens']:,}", a["prefill"],
            _ms(a["ttft_s"]), _ms(b["ttft_s"]), b["prefill"], f"{r['ttft_vs_turn1']:.2f}",
            f"{r['ttft_vs_no_reuse']:.2f}", _mb(a["kv_bytes"]), _mb(b["kv_bytes"]), moved,
            _n(p["decode_cached_tokens"]), _n(p["prefill_cached_tokens"]),
            _n(p["computed_tokens"]), yes[r["only_new_kv"]] if r["turn"] > 1 else "",
            yes[r["same_tokens"]],
        )  # fmt: skip
    t = doc["targets"]
    ok = {True: "met", False: "MISSED", None: "unknown"}

    def ratio(name: str, key: str) -> str:
        x = t[key]
        worst = "—" if x["worst"] is None else f"{x['worst']:.2f}"
        return (f"  TTFT ≤ {TARGET_RATIO} × {name}: worst {worst}, {x['turns_met']}/{x['of']} "
                f"turns — {ok[x['met']]}")  # fmt: skip

    new = t["only_new_kv"]
    return "\n".join([
        *header,
        render_rich(table, width + 60),  # its natural width: about 165 columns
        "targets (turns ≥ 2):",
        ratio("turn 1's", "ttft_vs_turn1"),
        ratio("the same turn without reuse", "ttft_vs_no_reuse"),
        f"  only the new tokens' KV moved: {new['turns_met']}/{new['of']} turns — {ok[new['met']]}",
        f"  same tokens with and without reuse, every turn: {yes[t['same_tokens']]}",
        "times in ms (client TTFT); new = prompt tokens after the last turn's prompt + reply; moved = prompt "
        "positions whose KV crossed; held = tokens the decode / prefill node already held; "
        "? = not reported by the nodes",
    ])  # fmt: skip


# ---- the command ----------------------------------------------------------------------------


def chat_model(args, progress) -> Path:
    """--model, else SmolLM2 (converted once into the cache), else with --quick a tiny
    checkpoint given a chat template."""
    if args.model is not None:
        return args.model
    if args.quick:
        from exo_split.bench.run import QUICK_CONFIG, bench_model
        from exo_split.models.tiny import add_chat_template

        return add_chat_template(bench_model(QUICK_CONFIG, progress, tag="-chat"))
    from exo_split.models.smollm2 import ensure_smollm2

    return ensure_smollm2(progress=lambda event: progress(str(event)) if not event.total else None)


def measure(args, cpus: tuple[int, int] | None, progress) -> dict:
    """Run the conversation; the JSON document."""
    from exo_split.chat import has_chat_template
    from exo_split.spec import load_spec

    t0, load = time.monotonic(), os.getloadavg()
    model = chat_model(args, progress)
    if not has_chat_template(model):
        raise BenchError(f"{model} has no chat template: --multiturn needs an instruct model")
    spec = load_spec(model)
    conv = conversation.quick(spec.vocab_size) if args.quick else conversation.full()
    max_tokens = args.max_tokens or (8 if args.quick else 32)
    node_args = []
    if args.prefix_cache_bytes:
        node_args = ["--prefix-cache-bytes", str(args.prefix_cache_bytes)]
    with Lab(model, cpus=cpus, logs=args.logs, progress=progress, loopback=True, warmup=True,
             node_args=node_args) as lab:  # fmt: skip
        progress("warming up: one remote and one local request, nothing kept")
        for where in ("remote", "local"):
            body = {"messages": [{"role": "user", "content": conv.system}], "max_tokens": 4,
                    "prefill": where, "prefix_cache": False}  # fmt: skip
            lab.call({"op": "generate", "url": lab.decode_url, "body": body})
        rows = converse(lab, conv, max_tokens, progress, later=args.suffix_prefill)
    return {
        "schema": SCHEMA,
        "quick": args.quick,
        "model": str(model),
        "cpus": {"prefill": cpus[0], "decode": cpus[1]} if cpus else None,
        "max_tokens": max_tokens,
        "prefix_cache_bytes": args.prefix_cache_bytes,
        "suffix_prefill": args.suffix_prefill,
        "load_average": {"start": load, "end": os.getloadavg()},
        "turns": rows,
        "targets": summarize(rows),
        "elapsed_s": time.monotonic() - t0,
    }


def main(args) -> int:
    """`exo-split bench --multiturn`: the card, then the JSON line."""
    from exo_split.bench import run

    previous = signal.signal(signal.SIGTERM, run.terminate)  # so the nodes are stopped
    try:
        doc = measure(args, run.cpus_of(args.cpus), run.progress_printer())
    finally:
        signal.signal(signal.SIGTERM, previous)
    doc["command"] = " ".join(["exo-split bench --multiturn", *run.argv_of(args)])
    print(render_card(doc), flush=True)
    print(json.dumps(doc), flush=True)
    return 0
