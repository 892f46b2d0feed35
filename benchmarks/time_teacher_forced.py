"""Seconds per (item, method) of the teacher-forced grid (`tasks.teacher_forced_grid`) on held-out retrieval items.

The first item prefills twice (the reference, then the first KVarN method, checking the two bit-equal); later items
prefill once, and every KVarN method replays that prefill into its own cache.

    python benchmarks/time_teacher_forced.py --model mla=DIR --context 8192 --items 3 --methods kvarn-2,kvarn-4
"""

from __future__ import annotations

import argparse
import time

import torch

from kvarn_mla.evaluation.methods import parse_methods
from kvarn_mla.evaluation.runner import load_model
from kvarn_mla.evaluation.sweep import SWEEP_SEED
from kvarn_mla.evaluation.tasks import retrieval_items, teacher_forced_grid


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mha", help="a bundled name, or NAME=DIR for a checkpoint directory")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--items", type=int, default=3)
    parser.add_argument("--methods", default="kvarn-2,kvarn-4", help="besides the reference (method grammar)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model.partition("=")[2] or args.model, torch.float32)
    items = retrieval_items(tokenizer, args.context, SWEEP_SEED, args.items)
    start = time.perf_counter()
    for method, record in teacher_forced_grid(model, tokenizer, items, parse_methods(args.methods)):
        now = time.perf_counter()
        print(f"{record['id']}  {method.name:24s} {now - start:6.1f} s  exact={record['exact']}", flush=True)
        start = now


if __name__ == "__main__":
    main()
