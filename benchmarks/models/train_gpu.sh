#!/usr/bin/env bash
# Train the three reference models side by side on one CUDA GPU, then evaluate code and retrieval there.
#
#   benchmarks/models/train_gpu.sh OUT [RECIPE[,RECIPE...]] [DEADLINE_MINUTES]
#
# Each model is one `train_reference.py NAME --device cuda` process (the models are small: three share the GPU);
# with several recipes, every recipe for every model in MODELS (an A/B side by side; five or six runs fit one H200).
# Training stops at the recipe's end or after DEADLINE_MINUTES of wall time (the results then say
# `stopped_at_deadline`). The held-out reasoning suite is left to the CPU (`--eval-only --eval-contexts ""`): its
# batched generation is long for the time a borrowed GPU has. OUT receives, as they land, each run's bf16 checkpoint
# (RECIPE-NAME.safetensors), then a tarball of the logs and the run directories' results and configs: the device
# returns eight files at most, so seven runs at most.
#
# The corpus is the stdlib of the Python the committed models were trained on: set KVARN_MLA_CODE_ROOT to a copy of
# it where another Python runs this (see kvarn_mla.evaluation.data).
set -uo pipefail
OUT=${1:?usage: train_gpu.sh OUT [RECIPE] [DEADLINE_MINUTES]}
RECIPES=${2:-v7}
DEADLINE=${3:-6}
HERE=$(cd "$(dirname "$0")" && pwd)
RUNS=${RUNS:-runs/gpu}
DEVICE=${DEVICE:-cuda}              # DEVICE=cpu EVAL_ITEMS=1 DEADLINE small: a check of this script on a CPU
EVAL_ITEMS=${EVAL_ITEMS:-100}
CONTEXTS=${CONTEXTS:-8192,16384,4096,2048}  # retrieval contexts evaluated here, in this order
INIT=${INIT:-}                      # a leg from checkpoints: INIT=DIR starts each model from DIR/NAME (a checkpoint dir)
SMOKE=${SMOKE:-1}
MODELS=${MODELS:-mla gqa mha}
mkdir -p "$OUT" "$RUNS" "$RUNS/logs"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
TRAIN=(python3 "$HERE/train_reference.py")
COMMON=(--device "$DEVICE" --threads 4)

# a smoke run first, so that a broken environment fails in seconds, not at the deadline
if [ "$SMOKE" = 1 ]; then
    "${TRAIN[@]}" mla --smoke "${COMMON[@]}" --run-dir "$RUNS/smoke" --monitor-every 2 --eval-items 2 \
        --eval-retrieval-items 1 --eval-contexts 1024 >"$RUNS/smoke.log" 2>&1 || { tail -40 "$RUNS/smoke.log"; exit 3; }
    echo "smoke ok: $(tail -1 "$RUNS/smoke.log")"
fi

pids=()
runs=()
for recipe in ${RECIPES//,/ }; do for name in $MODELS; do
    dir="$RUNS/$recipe-$name"
    runs+=("$recipe-$name")
    init=()
    [ -n "$INIT" ] && init=(--init "$INIT/$name")
    "${TRAIN[@]}" "$name" --recipe "$recipe" "${init[@]}" "${COMMON[@]}" --tokenizer-dir kvarn_mla/reference_models/gqa \
        --run-dir "$dir" --monitor-every 100 --save-every 500 --deadline-minutes "$DEADLINE" --eval-items 0 --eval-retrieval-items "$EVAL_ITEMS" \
        --eval-contexts "$CONTEXTS" \
        >"$RUNS/logs/train-$recipe-$name.log" 2>&1 &
    pids+=($!)
done; done
# copy each checkpoint out as soon as it is whole (the tokenizer is written after the weights)
(
    while sleep 5; do
        for run in "${runs[@]}"; do
            m="$RUNS/$run/model"
            [ -f "$m/tokenizer.json" ] && [ ! -f "$OUT/$run.safetensors" ] && cp "$m/model.safetensors" "$OUT/$run.safetensors"
        done
    done
) &
watcher=$!
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
sleep 6
kill "$watcher" 2>/dev/null
tar -czf "$OUT/runs.tar.gz" --exclude='state.pt' --exclude='*.safetensors' --exclude='tokenizer*' -C "$RUNS" .
python3 - "$RUNS" "${runs[@]}" <<'EOF'
import json, sys
from pathlib import Path
runs = Path(sys.argv[1])
for name in sys.argv[2:]:
    f = runs / name / "results.json"
    if not f.exists():
        print(f"{name}: no results")
        continue
    m = json.loads(f.read_text())
    phases = " ".join(f"{p['name']}:{p['steps']}" for p in m["recipe"]["phases"])
    code = m.get("held_out_code", {}).get("nll_over_own_unigram_entropy")
    ret = " ".join(f"@{r['context']} {r['correct']}/{r['n']}" for r in m.get("held_out_retrieval", []))
    print(f"{name}: steps {m['steps_done']} deadline {m['stopped_at_deadline']} train {m['train_seconds'] / 60:.1f} min"
          f" | {phases} | code {code} | retrieval {ret}")
EOF
exit $status
