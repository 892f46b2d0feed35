"""Print the README tables from ``benchmarks/models/results/*.json`` (every number comes from those files).

python benchmarks/models/summarize.py > /tmp/tables.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
NAMES = ("mla", "gqa", "mha")


def kv_bytes_per_token_layer(cfg: dict) -> int:
    """16-bit KV-cache bytes one token takes in one layer (MLA: latent + RoPE key; else K and V)."""
    if "kv_lora_rank" in cfg:
        return 2 * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * 2 * cfg["num_key_value_heads"] * head_dim


def attention(cfg: dict) -> str:
    heads = cfg["num_attention_heads"]
    if "kv_lora_rank" in cfg:
        return (
            f"MLA, {heads} heads, kv_lora_rank {cfg['kv_lora_rank']}, nope {cfg['qk_nope_head_dim']}, "
            f"rope {cfg['qk_rope_head_dim']}, v {cfg['v_head_dim']}"
        )
    return f"{heads} q heads / {cfg['num_key_value_heads']} kv heads x {cfg.get('head_dim')}"


def main() -> None:
    runs = {n: json.loads((RESULTS / f"{n}.json").read_text()) for n in NAMES if (RESULTS / f"{n}.json").exists()}
    if not runs:
        sys.exit(f"no results in {RESULTS}")
    print("| model | class | attention | params (non-emb.) | KV bytes/token/layer (16-bit) | checkpoint |")
    print("|---|---|---|---|---|---|")
    for n, m in runs.items():
        c, p = m["config"], m["params"]
        full = {**c, "num_attention_heads": c.get("num_attention_heads"), "hidden_size": c.get("hidden_size")}
        print(
            f"| {n} | `{m['architecture']}` | {attention(full)} | {p['total'] / 1e6:.2f}M "
            f"({p['non_embedding'] / 1e6:.2f}M) | {kv_bytes_per_token_layer(full)} | "
            f"{m['checkpoint_bytes'] / 2**20:.2f} MiB |"
        )
    print()
    print("| model | steps | tokens seen (loss tokens; reasoning targets) | train time | final loss (last 20 steps) |")
    print("|---|---|---|---|---|")
    for n, m in runs.items():
        s = m["tokens_seen"]
        print(
            f"| {n} | {m['steps_done']} | {s['input_tokens'] / 1e6:.2f}M ({s['loss_tokens'] / 1e6:.2f}M; "
            f"{s['reasoning_loss_tokens'] / 1e6:.2f}M) | {m['train_seconds'] / 60:.1f} min | "
            f"{m['final_train_loss_mean_last_20']:.3f} |"
        )
    print()
    print(
        "| model | held-out code ppl | unigram ppl | code tokens scored | reasoning exact match | "
        "95% Wilson | final answer only |"
    )
    print("|---|---|---|---|---|---|---|")
    for n, m in runs.items():
        c, r = m["held_out_code"], m["held_out_reasoning"]
        lo, hi = r["wilson95"]
        print(
            f"| {n} | {c['perplexity']:.2f} | {c['unigram_perplexity']:.1f} | {c['tokens_scored']:,} | "
            f"{r['exact_match']:.3f} ({r['correct']}/{r['n']}) | {lo:.3f}-{hi:.3f} | {r['final_answer_acc']:.3f} |"
        )
    print()
    steps = sorted({h["step"] for m in runs.values() for h in m["history"] if "tf_acc_cell" in h})
    if steps:
        print(
            "Monitoring during training (16 other held-out items; teacher-forced cell accuracy / greedy exact match):\n"
        )
        print("| step | " + " | ".join(runs) + " |")
        print("|---|" + "---|" * len(runs))
        for st in steps:
            cells = []
            for m in runs.values():
                h = next((h for h in m["history"] if h["step"] == st and "tf_acc_cell" in h), None)
                cells.append(f"{h['tf_acc_cell']:.3f} / {h['monitor_exact_match']:.2f}" if h else "")
            print(f"| {st} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
