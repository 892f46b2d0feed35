"""Install a finished training run as a bundled reference model: its bf16 checkpoint into
``kvarn_mla/reference_models/<name>/`` and its metrics into ``benchmarks/models/results/<name>.json``.

    python benchmarks/models/ship.py mla --run-dir runs/v2-mla
    python benchmarks/models/ship.py mla --run-dir runs/v2-mla --check   # report only, write nothing

The run directory holds what ``train_reference.py --run-dir D --out-dir D/model --results D/results.json`` wrote:
``model/`` (the bf16 checkpoint) and ``results.json`` (its held-out evaluation, run on that checkpoint). A run stopped
during its final evaluation (the checkpoint and the last ``state.pt`` are written before it) has no
``results.json``: its metrics are then rebuilt from ``state.pt`` and every evaluation is listed as missing. The
checkpoint's config gets the reasoning task version the recipe trains on (``reasoning_task``: evaluations pick
the task from it; a config without it means version 1, the first reference models).

Refused, with the reason: a run that has not finished its recipe, whose recipe is none of this checkout's
(``train_reference.RECIPES``: the full recipe or a leg from a bundled model, such as ``lookup``) or whose reasoning
task differs from ``train_reference.TASK``; a checkpoint that is not bf16 or is over
16 MiB. Evaluations missing from ``results.json`` (code, reasoning, retrieval at each of ``--contexts``) are run on
the installed checkpoint by ``train_reference.py --eval-only``, which adds them to the installed results (with
``--no-evaluate`` the command is printed instead and the exit status is 1).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a plain script from a checkout
    sys.path.insert(0, str(REPO))

import train_reference as T  # noqa: E402  (this folder is on the path: the script's own)

from kvarn_mla.evaluation import reasoning  # noqa: E402

MAX_BYTES = 16 * 2**20  # a shipped checkpoint's files, all together
CONTEXTS = (2048, 4096, 8192, 16384)  # retrieval contexts the results must hold (the issue reports all four)


def recipe_of(metrics: dict) -> str | None:
    """Name of the recipe in ``train_reference.RECIPES`` that the run in ``metrics`` trained on (None: none is). A
    gated phase (``Phase.until``) that ended early is saved with the steps it ran: it matches its recipe's phase of
    at least that many steps."""
    saved = json.loads(json.dumps(metrics.get("recipe")))
    return next((k for k, r in T.RECIPES.items() if saved == T.recipe_json(_as_run(r, saved))), None)


def _as_run(recipe: "T.Recipe", saved: object) -> "T.Recipe":
    """``recipe`` with its gated phases cut to the steps ``saved`` (a recipe as JSON) ran, where that is fewer."""
    phases = saved.get("phases") if isinstance(saved, dict) else None
    if not isinstance(phases, list) or len(phases) != len(recipe.phases):
        return recipe
    ran = {
        p.name: q["steps"]
        for p, q in zip(recipe.phases, phases)
        if p.until is not None
        and isinstance(q, dict)
        and q.get("name") == p.name
        and isinstance(q.get("steps"), int)
        and 0 < q["steps"] < p.steps
    }
    return recipe.ended_early(ran)


def problems(metrics: dict, checkpoint: Path, smoke: bool = False) -> list[str]:
    """Why the run in ``metrics`` / ``checkpoint`` cannot ship (empty when it can): it must have finished one of
    ``train_reference.RECIPES`` (the full recipe, or a leg such as ``lookup``; ``smoke``: the smoke recipe only)."""
    out = []
    name = recipe_of(metrics)
    if name is None or (name == "smoke") != smoke:
        out.append("the run's recipe is none of train_reference.py's (a checkout other than the one it trained in?)")
    elif metrics.get("steps_done") != (steps := _as_run(T.RECIPES[name], metrics["recipe"]).steps):
        out.append(f"the run stopped at step {metrics.get('steps_done')} of the recipe's {steps}")
    if metrics.get("stopped_at_deadline"):
        out.append("the run was stopped at its --deadline-minutes, not at the end of its recipe")
    config = json.loads((checkpoint / "config.json").read_text())
    if config.get("dtype") != "bfloat16":
        out.append(f"the checkpoint is {config.get('dtype')}, not bfloat16")
    if reasoning.TASK_KEY in config and reasoning.task_of(config) is not T.TASK:
        out.append(f"the checkpoint records reasoning task {config[reasoning.TASK_KEY]}, the recipe {T.TASK}")
    task = metrics.get("held_out_reasoning", {}).get("task")
    if task is not None and {k: v for k, v in task.items() if k != "version"} != {
        k: v for k, v in T.TASK.to_dict().items() if k != "version"
    }:
        out.append(f"the reasoning evaluation ran on task {task}, not version {T.TASK.version}: {T.TASK.to_dict()}")
    size = sum(f.stat().st_size for f in checkpoint.iterdir() if f.is_file())
    if size > MAX_BYTES:
        out.append(f"the checkpoint holds {size / 2**20:.2f} MiB, over {MAX_BYTES / 2**20:.0f} MiB")
    return out


def missing_evaluations(metrics: dict, contexts: tuple[int, ...], items: int = 100) -> list[str]:
    """The evaluations ``metrics`` lacks, as ``train_reference.py`` flags that add them (``items`` reasoning items and
    retrieval items per context, as the runs evaluate)."""
    flags = []
    if "held_out_code" not in metrics:
        flags.append("--eval-code-window 2048")
    if "held_out_reasoning" not in metrics:
        flags.append(f"--eval-items {items}")
    done = {r["context"] for r in metrics.get("held_out_retrieval", [])}
    todo = [c for c in contexts if c not in done]
    if todo:
        flags.append(f"--eval-retrieval-items {items} --eval-contexts {','.join(map(str, todo))}")
    return flags


def metrics_from_state(name: str, state_path: Path, checkpoint: Path) -> dict:
    """What ``train_reference.py`` writes before its evaluations, rebuilt from the run's last state."""
    import numpy as np
    import torch
    import transformers

    from kvarn_mla.evaluation.data import corpus_info

    st = torch.load(state_path, weights_only=False, map_location="cpu")
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    history = st["history"]
    return {
        "name": name,
        "architecture": type(model).__name__,
        "recipe_name": recipe_of({"recipe": st["recipe"]}),
        "recipe": st["recipe"],
        "steps_done": st["step"],
        "params": T.count_params(model),
        "config": {k: v for k, v in model.config.to_diff_dict().items() if not k.startswith("_") and k != "dtype"},
        "tokens_seen": st["seen"],
        "train_seconds": st["train_seconds"],
        "final_train_loss_mean_last_20": float(np.mean([h["loss"] for h in history[-20:]])),
        "environment": {**corpus_info(), "torch": torch.__version__, "transformers": transformers.__version__},
        "command": f"python benchmarks/models/train_reference.py {name} --threads 1 (metrics rebuilt from "
        f"{state_path} by ship.py: the run stopped in its final evaluation)",
        "history": history,
    }


def install(name: str, checkpoint: Path, metrics: dict, package: Path, results: Path) -> dict:
    """Copy ``checkpoint`` to ``package/<name>`` with the recipe's reasoning task recorded in its config, and write
    ``metrics`` (checkpoint sizes of the installed files, the task recorded) to ``results``; returns the metrics."""
    target = package / name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(checkpoint, target)
    config = json.loads((target / "config.json").read_text())
    config[reasoning.TASK_KEY] = T.TASK.to_dict()
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    files = {f.name: f.stat().st_size for f in sorted(target.iterdir()) if f.is_file()}
    metrics = {**metrics, "checkpoint_bytes": sum(files.values()), "checkpoint_files": files}
    if "held_out_reasoning" in metrics:
        metrics["held_out_reasoning"] = {**metrics["held_out_reasoning"], "task": T.TASK.to_dict()}
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(metrics, indent=1, default=str) + "\n")
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=T.MODEL_NAMES)
    parser.add_argument("--run-dir", type=Path, required=True, help="the training run (model/ and results.json)")
    parser.add_argument("--checkpoint", type=Path, help="checkpoint directory (default RUN_DIR/model)")
    parser.add_argument("--run-results", type=Path, help="the run's metrics (default RUN_DIR/results.json)")
    parser.add_argument("--package", type=Path, default=T.DEFAULT_OUT_ROOT, help="where the checkpoints ship")
    parser.add_argument("--results-dir", type=Path, default=T.DEFAULT_RESULTS, help="where the metrics go")
    parser.add_argument(
        "--contexts",
        type=lambda s: tuple(int(c) for c in s.split(",") if c),
        default=CONTEXTS,
        help="retrieval contexts the results must hold (default 2048,4096,8192,16384)",
    )
    parser.add_argument("--smoke", action="store_true", help="the run used --smoke (tests)")
    parser.add_argument("--threads", type=int, default=1, help="threads of the evaluations run here")
    parser.add_argument("--items", type=int, default=100, help="items of a missing evaluation (default 100)")
    parser.add_argument("--no-evaluate", action="store_true", help="print the command for missing evaluations")
    parser.add_argument("--check", action="store_true", help="report what would ship and why not; write nothing")
    args = parser.parse_args(argv)

    checkpoint = args.checkpoint or args.run_dir / "model"
    run_results = args.run_results or args.run_dir / "results.json"
    state = args.run_dir / "state.pt"
    if not (checkpoint / "config.json").is_file():
        print(f"ship: {checkpoint / 'config.json'} is missing (has the run finished?)", file=sys.stderr)
        return 2
    if run_results.is_file():
        metrics = json.loads(run_results.read_text())
    elif state.is_file():
        print(f"ship: no {run_results}; metrics rebuilt from {state}", file=sys.stderr)
        metrics = metrics_from_state(args.name, state, checkpoint)
    else:
        print(f"ship: neither {run_results} nor {state} (has the run finished?)", file=sys.stderr)
        return 2
    refused = problems(metrics, checkpoint, args.smoke)
    if refused:
        print(f"ship: {args.name} cannot ship:\n  " + "\n  ".join(refused), file=sys.stderr)
        return 2
    results = args.results_dir / f"{args.name}.json"
    flags = missing_evaluations(metrics, args.contexts, args.items)
    if args.check:
        print(f"ship: {args.name} can ship from {checkpoint}" + (f"; missing: {' '.join(flags)}" if flags else ""))
        return 0
    metrics = install(args.name, checkpoint, metrics, args.package, results)
    print(f"ship: {args.name}: {metrics['checkpoint_bytes'] / 2**20:.2f} MiB in {args.package / args.name}, {results}")
    if flags:
        command = [args.name, "--eval-only", "--threads", str(args.threads), "--out-dir", str(args.package / args.name)]
        command += ["--results", str(results), "--eval-items", "0", "--eval-code-window", "0", "--eval-contexts", ""]
        command += [word for flag in flags for word in flag.split()] + (["--smoke"] if args.smoke else [])
        if args.no_evaluate:
            print(
                "ship: evaluations missing; add them to the installed files with\n  python "
                "benchmarks/models/train_reference.py " + " ".join(c if c else "''" for c in command),
                file=sys.stderr,
            )
            return 1
        print(f"ship: running the missing evaluations: {' '.join(flags)}", flush=True)
        T.main(command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
