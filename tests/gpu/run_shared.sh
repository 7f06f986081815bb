#!/usr/bin/env bash
# Every multi-rank GPU check on a machine with ONE GPU: the launcher (uccl_ep_megatron.cluster.local)
# places 2/4/8 ranks on GPU 0 under CUDA MPS in a gloo group: bash tests/gpu/run_shared.sh
# Optional folders beside the checkout (.git/info/exclude ignores them):
#   .baselines/deepep-v1  DeepEP V1 source (../shared/baselines/deepep-v1/BASELINE.md), built here;
#   .whl/                 wheels for Python 3.12 (megatron-core) installed into /tmp/site;
#   .prebuilt/            _C and deep_ep extensions an earlier call built (their source hash in
#                         the file name): reused when csrc/ and the DeepEP source are unchanged.
# Every run writes the extensions it built to $OUT/prebuilt.tar.gz; untar it into .prebuilt/.
# Env: STEPS (default "intranode internode fifo others megatron bench_intranode bench_internode";
#      also mps_probe, pretrain, bench_layer), LAYER_ARGS (extra bench layer flags), MC (megatron-core version whose wheels .whl/mc-<MC>/ holds,
#      default 0.19.2),
#      RANKS (intranode tests, default 2,4,8), BENCH_RANKS (bench intranode, default 2,4,8), RPN (internode ranks per node, default 1,2,4),
#      BENCH_ARGS (extra bench intranode flags), PYTEST_K (-k filter), INTERNODE_K (-k filter of the
#      internode suite), MAXFAIL (pytest --maxfail, default 3), DEADLINE_S (default 570),
#      INTRANODE_S (limit of the intranode step, default 300).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=16 MAX_JOBS=16
OUT=${OUT:-/tmp/out}
REPO=$(pwd)
LOGS=/tmp/logs
SITE=/tmp/uccl
DEADLINE=$((SECONDS + ${DEADLINE_S:-570}))
STEPS=${STEPS:-intranode internode fifo others megatron bench_intranode bench_internode}
mkdir -p "$OUT" "$LOGS" "$SITE/uccl_ep_megatron" /tmp/prebuilt
want() { [[ " $STEPS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$LOGS/gpu.txt"
echo "commit $(git rev-parse --short HEAD 2>/dev/null) steps: $STEPS"

wheels=$(ls .whl/*.whl ".whl/mc-${MC:-0.19.2}"/*.whl 2> /dev/null)
if [ -n "$wheels" ]; then
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $wheels > "$LOGS/wheels.log" 2>&1 || tail -3 "$LOGS/wheels.log"
fi

# The package: this tree's Python, plus _C built from csrc/ (or reused when the hash matches).
src_hash=$(find CMakeLists.txt pyproject.toml csrc -type f | sort | xargs cat | sha1sum | cut -c1-12)
cp -r uccl_ep_megatron/. "$SITE/uccl_ep_megatron/"
cp -r token_dispatcher "$SITE/uccl_ep_megatron/token_dispatcher"
mkdir -p "$SITE/uccl_ep_megatron/data" && cp -r recipes "$SITE/uccl_ep_megatron/data/recipes" \
  && cp -r launch "$SITE/uccl_ep_megatron/data/launch"
# The extensions: _C in the package, _bench_C (benchmark/test kernels) in its bench/ folder.
so_dir() { if [ "$1" = _bench_C ]; then echo "$2/uccl_ep_megatron/bench"; else echo "$2/uccl_ep_megatron"; fi; }
build_c() {
  if ls .prebuilt/_C."$src_hash".*.so .prebuilt/_bench_C."$src_hash".*.so > /dev/null 2>&1; then
    for m in _C _bench_C; do
      f=$(ls .prebuilt/"$m"."$src_hash".*.so)
      cp "$f" "$(so_dir "$m" "$SITE")/$m.${f##*/"$m"."$src_hash".}"
    done
    echo "_C and _bench_C reused (hash $src_hash)"
    return 0
  fi
  local t=$SECONDS
  timeout 300 python3 -m pip install --no-build-isolation --no-deps -q -C build-dir=/tmp/b \
    -C cmake.define.UCCL_EP_CUDA_ARCHS=90 --target /tmp/whl_site . > "$LOGS/build.log" 2>&1 \
    || { echo "build FAILED"; tail -30 "$LOGS/build.log"; return 1; }
  for m in _C _bench_C; do
    so=$(ls "$(so_dir "$m" /tmp/whl_site)"/"$m".*.so)
    cp "$so" "$(so_dir "$m" "$SITE")/"
    cp "$so" "/tmp/prebuilt/$m.$src_hash.${so##*/"$m".}"
  done
  echo "_C and _bench_C built in $((SECONDS - t)) s (hash $src_hash)"
}
build_deepep() {
  [ -d .baselines/deepep-v1 ] || { echo "no .baselines/deepep-v1: DeepEP not timed"; return 0; }
  local h
  h=$(find .baselines/deepep-v1/csrc .baselines/deepep-v1/setup.py -type f | sort | xargs cat \
    | sha1sum | cut -c1-12)
  mkdir -p /tmp/deepep && cp -r .baselines/deepep-v1/deep_ep /tmp/deepep/
  if ls .prebuilt/deep_ep_cpp."$h".*.so > /dev/null 2>&1; then
    f=$(ls .prebuilt/deep_ep_cpp."$h".*.so)
    cp "$f" "/tmp/deepep/deep_ep_cpp.${f##*/deep_ep_cpp.$h.}"
    echo "deep_ep reused (hash $h)"
    return 0
  fi
  local t=$SECONDS
  (cd .baselines/deepep-v1 && TORCH_CUDA_ARCH_LIST=9.0 timeout 300 python3 setup.py build_ext \
    --inplace) > "$LOGS/deepep_build.log" 2>&1 || { echo "deep_ep build FAILED"; tail -20 \
    "$LOGS/deepep_build.log"; return 0; }
  f=$(ls .baselines/deepep-v1/deep_ep_cpp*.so)
  cp "$f" /tmp/deepep/
  cp "$f" "/tmp/prebuilt/deep_ep_cpp.$h${f##*/deep_ep_cpp}"
  echo "deep_ep built in $((SECONDS - t)) s"
}
build_c & bc=$!
build_deepep & bd=$!
wait $bd
wait $bc || { tar -czf "$OUT/logs.tar.gz" -C /tmp logs; exit 1; }
tar -czf "$OUT/prebuilt.tar.gz" -C /tmp prebuilt
export PYTHONPATH=$SITE:/tmp/deepep:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
cd /tmp || exit 1 # import the installed package, not the source tree
python3 -c "import uccl_ep_megatron._C as C; print('package ok', C.build_info)" || exit 1
PYTEST=(python3 -X faulthandler -m pytest -q -p no:cacheprovider --import-mode=importlib
  -o addopts="" -o faulthandler_timeout=170 --timeout=150 --maxfail="${MAXFAIL:-3}" -rA
  --tb=short --durations=8)
[ -n "${PYTEST_K:-}" ] && PYTEST+=(-k "$PYTEST_K")

# step NAME LIMIT CMD...: one summary line per step.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 20 ]; then echo "$name: not run (deadline)" >> "$LOGS/summary.txt"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t=$SECONDS
  timeout -k 5 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  printf '%-26s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t))" \
    "$(grep -E '[0-9]+ (passed|failed|error|skipped)' "$LOGS/$name.log" | tail -1 | cut -c1-80)" \
    >> "$LOGS/summary.txt"
}
if want mps_probe; then # which client setting lets the ipc proxies' copies run under MPS
  for v in default CUDA_DEVICE_MAX_CONNECTIONS=32 CUDA_MODULE_LOADING=EAGER; do
    (
      [ "$v" != default ] && export "${v?}"
      export UCCL_EP_TEST_RANKS_PER_NODE=1 UCCL_EP_TEST_KERNEL_TIMEOUT_MS=8000
      step "probe_${v%%=*}" 90 "${PYTEST[@]}" -k "t127 and ordered" "$REPO/tests/gpu/test_internode.py"
    )
  done
fi
want intranode && UCCL_EP_TEST_RANKS=${RANKS:-2,4,8} step intranode "${INTRANODE_S:-300}" "${PYTEST[@]}" \
  "$REPO/tests/gpu/test_intranode.py"
want internode && UCCL_EP_TEST_RANKS_PER_NODE=${RPN:-1,2,4} UCCL_EP_TEST_KERNEL_TIMEOUT_MS=15000 \
  step internode 300 "${PYTEST[@]}" ${INTERNODE_K:+-k "$INTERNODE_K"} \
  "$REPO/tests/gpu/test_internode.py"
want fifo && step fifo 120 "${PYTEST[@]}" "$REPO/tests/gpu/test_fifo_gpu.py"
if want others; then # every other GPU test file, and the CPU tests that need a GPU build
  others=$(ls "$REPO"/tests/gpu/test_*.py | grep -vE "test_(intranode|internode|fifo_gpu|megatron_gpu|pretrain_gpt_gpu)\.py")
  # shellcheck disable=SC2086
  step others 260 "${PYTEST[@]}" $others "$REPO/tests/test_bindings_checks.py"
fi
want megatron && step megatron 150 "${PYTEST[@]}" -s "$REPO/tests/gpu/test_megatron_gpu.py"
want pretrain && OUT=$LOGS step pretrain 300 "${PYTEST[@]}" -s \
  "$REPO/tests/gpu/test_pretrain_gpt_gpu.py"
# shellcheck disable=SC2086
want bench_intranode && step bench_intranode 330 python3 -m uccl_ep_megatron.cli bench intranode \
  --ranks "${BENCH_RANKS:-2,4,8}" --json "$LOGS/bench_intranode.json" ${BENCH_ARGS:-}
# shellcheck disable=SC2086
want bench_layer && step bench_layer 240 python3 -m uccl_ep_megatron.cli bench layer \
  --json "$LOGS/bench_layer.json" ${LAYER_ARGS:-}
want bench_internode && step bench_internode 150 python3 -m uccl_ep_megatron.cli bench internode \
  --ranks 4 --ranks-per-node 2 --threads 2,4 --iters 5 --json "$LOGS/bench_internode.json"

tar -czf "$OUT/logs.tar.gz" -C /tmp logs
echo "================ summary (elapsed $SECONDS s)"
cat "$LOGS/summary.txt" 2>/dev/null
for f in "$LOGS"/*.log; do
  grep -HE "^(FAILED|ERROR)|Error:|Timeout" "$f" 2>/dev/null | head -4 | cut -c1-250
done
for b in bench_intranode bench_layer bench_internode; do
  [ -f "$LOGS/$b.log" ] && { echo "---- $b"; grep -vE "Warning|warn\(|return func" "$LOGS/$b.log" | tail -40; }
done
