#!/usr/bin/env bash
# The training side on GPUs (4 H100 or H200): TorchGroupedMLP (grouped_mm experts) and FP8 dispatch
# tests, `bench layer` at EP4 and EP2, and `train --compare` of the default recipe. STEPS picks
# a subset, so the run fits a time budget; a second run on the same machine reuses the build:
#   STEPS='tests bench_ep2' bash tests/gpu/run_train_gpu.sh
#   STEPS='bench_ep4 train' bash tests/gpu/run_train_gpu.sh
# .whl/: the megatron-core wheel for Python 3.12 (0.16.1 or newer), installed into /tmp/site.
# Env: STEPS (default "tests bench_ep2 bench_ep4 train"), LAYER_ARGS (extra flags of the EP4
#      bench layer), ITERS (train iterations, default 20).
# Writes to $OUT: pytest_train.log, layer-ep2.json, layer-ep4.json, train.log, train-ep4.json.
set -uo pipefail
# shellcheck source=tests/gpu/device_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-tests bench_ep2 bench_ep4 train}
want() { [[ " $STEPS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > "$OUT/wheels.log" 2>&1 || tail -3 "$OUT/wheels.log"
  export PYTHONPATH=/tmp/site
fi
tree=$(find CMakeLists.txt pyproject.toml csrc uccl_ep_megatron token_dispatcher recipes launch \
  -type f -not -name '*.pyc' | sort | xargs cat | sha1sum | cut -c1-12)
built=/tmp/b/.built-$tree  # a warm machine's second call reuses the build of the same tree
if [ -f "$built" ] && (cd /tmp && python3 -c "import uccl_ep_megatron._C" 2> /dev/null); then
  echo "package already built for this tree ($tree)"
else
  build_sm90
  touch "$built"
fi
python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)"
cd /tmp || exit 1  # import the installed package, not the source tree
rc=0

if want tests; then
  echo "=== tests/gpu/test_grouped_experts.py"
  timeout 300 python3 -m pytest -q -s -p no:cacheprovider --import-mode=importlib -o addopts="" \
    --timeout=240 "$REPO/tests/gpu/test_grouped_experts.py" > "$OUT/pytest_train.log" 2>&1 || rc=1
  grep -E "passed|failed|skipped|Error|assert|^(exact|sync-free|exact-fp8) " "$OUT/pytest_train.log" \
    | tail -25
fi
if want bench_ep2; then
  echo "=== bench layer, EP2, hidden 4096, 64 experts, 2048 tokens/rank"
  timeout 240 python3 -m uccl_ep_megatron.cli bench layer --gpus 2 --hidden 4096 --experts 64 \
    --ffn 1408 --shared-ffn 1408 --tokens 2048 --json "$OUT/layer-ep2.json" || rc=1
fi
if want bench_ep4; then
  echo "=== bench layer, EP4, DeepSeek-V3 layer ${LAYER_ARGS:-}"
  # shellcheck disable=SC2086
  timeout 300 python3 -m uccl_ep_megatron.cli bench layer --gpus 4 ${LAYER_ARGS:-} \
    --json "$OUT/layer-ep4.json" || rc=1
fi
if want train; then
  echo "=== train --compare alltoall,flex (default recipe, 4 GPUs)"
  rm -rf /tmp/runs/compare
  t=$SECONDS
  timeout 420 python3 -m uccl_ep_megatron.cli train --gpus 4 --iters "${ITERS:-20}" --no-wandb \
    --compare alltoall,flex --run-dir /tmp/runs/compare > "$OUT/train.log" 2>&1 || rc=1
  echo "train --compare took $((SECONDS - t)) s"
  tail -25 "$OUT/train.log"
  python3 - "$OUT/train-ep4.json" <<'PY'
import json, pathlib, sys
from uccl_ep_megatron.telemetry.metrics import read_jsonl
from uccl_ep_megatron.telemetry.report import summarize
runs = {}
for d in sorted(pathlib.Path("/tmp/runs/compare").iterdir()):
    if (d / "config.json").exists() and (d / "metrics.jsonl").exists():
        records = read_jsonl(d)
        config = json.loads((d / "config.json").read_text())
        keep = ("dispatcher", "dispatch_mode", "fp8_dispatch", "experts", "gpu", "world_size")
        runs[d.name] = {**{k: config.get(k) for k in keep}, **summarize(records, 3),
                        "losses": [r["loss"] for r in records]}
json.dump({"runs": runs}, open(sys.argv[1], "w"), indent=2)
for name, r in runs.items():
    print(f"{name:10} {r['experts']:16} {r['dispatch_mode']:10} {r['tokens_per_s']:12,.0f} tok/s "
          f"MFU {100 * r.get('mfu', 0):5.1f}%  loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}")
PY
fi
exit $rc
