#!/usr/bin/env bash
# Megatron-LM's unmodified pretrain_gpt.py at EP = the GPUs present (4), one run per dispatcher,
# the same model, seed and mock data: `alltoall`, `uccl_ep` exact, `uccl_ep` sync-free without a
# capacity (`_sfd`: --moe-uccl-ep-sync-free, drops nothing), `flex` on DeepEP V1 (when its NVSHMEM
# build is beside the checkout), each also with Megatron's EP overlap
# (--overlap-moe-expert-parallel-comm; suffix `_ov`). Suffix `_vn`: through the internode path
# (2 virtual nodes over the ipc NIC model, 50 GB/s per GPU, 3 us). Sync-free with a capacity
# (`_sf`) drops the pairs past 1.25x an expert's even share, as Megatron's
# --moe-expert-capacity-factor 1.25 does (`alltoall_cf`). Experts: PyTorch's grouped GEMM for every
# dispatcher (--moe-uccl-ep-grouped-experts; no Transformer Engine on the device image). Writes each
# run's log and $OUT/pretrain-gpt.json (per run: every iteration's time and loss, the median
# iteration time after WARMUP iterations, tokens/s, the command).
#
# Needs Megatron-LM's sources (MEGATRON_LM, default .baselines/Megatron-LM: pretrain_gpt.py,
# gpt_builders.py, model_provider.py and megatron/ of one commit) and, for `flex`, DeepEP V1 built
# with NVSHMEM in .baselines/deepep-v1 (../shared/baselines/deepep-v1/BASELINE.md):
#   bash tests/gpu/run_pretrain_gpt.sh
# Env: RUNS (default "alltoall uccl_ep uccl_ep_sfd flex alltoall_ov uccl_ep_ov uccl_ep_sfd_ov
#      flex_ov"; also alltoall_cf, uccl_ep_sf, uccl_ep_vn, uccl_ep_sf_vn, and uccl_ep_fp8 for FP8
#      dispatch),
#      ITERS (default 25), WARMUP (default 5), SHAPE (extra model flags), OUT, METRICS=1 (every
#      run with --moe-uccl-ep-metrics: each dispatcher's exchange time per iteration and its
#      permutation around it, forward and backward, from the log's `uccl_ep metrics` lines; the
#      JSON gains them and the speed-up a dispatcher that cost nothing would give, iteration ms
#      / (ms - exchange ms - permute ms)).
set -uo pipefail
# shellcheck source=tests/gpu/device_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
export PYTHONUNBUFFERED=1
MEGATRON_LM=$(cd "${MEGATRON_LM:-$REPO/.baselines/Megatron-LM}" && pwd)
DEEPEP=/tmp/deepep-nvshmem  # a copy: the plain build of .baselines/deepep-v1 lacks NVSHMEM
RUNS=${RUNS:-alltoall uccl_ep uccl_ep_sfd flex alltoall_ov uccl_ep_ov uccl_ep_sfd_ov flex_ov}
ITERS=${ITERS:-25}
WARMUP=${WARMUP:-5}
GPUS=$(nvidia-smi -L | wc -l)
SEQ=4096
GBS=16

# 4 MoE layers of hidden 4096, 64 experts of width 1408, top-8; 16 sequences of 4096 tokens per
# iteration (4 micro-batches per rank at EP4, so the overlap schedule has pairs to overlap).
MODEL="--num-layers 4 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008
  --seq-length $SEQ --max-position-embeddings $SEQ --position-embedding-type rope
  --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights
  --attention-dropout 0 --hidden-dropout 0
  --num-experts 64 --moe-router-topk 8 --moe-ffn-hidden-size 1408 --moe-router-dtype fp32
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3 ${SHAPE:-}"
TRAINING="--micro-batch-size 1 --global-batch-size $GBS --train-iters $ITERS --lr 1e-4
  --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0
  --bf16 --seed 1234 --log-interval 1 --eval-iters 0 --eval-interval 1000000 --mock-data
  --tokenizer-type NullTokenizer --vocab-size 32000
  --tensor-model-parallel-size 1 --expert-model-parallel-size $GPUS"
NO_TE="--transformer-impl local --no-persist-layer-norm --disable-bias-linear
  --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-dropout-fusion
  --no-rope-fusion --moe-uccl-ep-grouped-experts"

if ls .whl/*.whl > /dev/null 2>&1 && [ ! -d "$MEGATRON_LM/megatron/core" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > "$OUT/wheels.log" 2>&1 && export PYTHONPATH=/tmp/site
fi
if [[ " $RUNS " == *" flex"* ]] && [ -d "$REPO/.baselines/deepep-v1" ] \
  && ! ls "$DEEPEP"/deep_ep_cpp*.so > /dev/null 2>&1; then
  rm -rf "$DEEPEP" && cp -r "$REPO/.baselines/deepep-v1" "$DEEPEP" && rm -f "$DEEPEP"/*.so
  (cd "$DEEPEP" && DEEPEP_WITH_NVSHMEM=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=32 \
    timeout 300 python3 setup.py build_ext --inplace > "$OUT/deepep_build.log" 2>&1) &
fi
build_sm90
wait
cd "$MEGATRON_LM" || exit 1
rc=0
for run in $RUNS; do
  extra=()
  env_run=(CUDA_DEVICE_MAX_CONNECTIONS=1)
  case $run in
    alltoall_cf*) # the sync-free runs' capacity, tokens past it dropped as Megatron does
      extra+=(--moe-token-dispatcher-type alltoall --moe-expert-capacity-factor 1.25) ;;
    alltoall*) extra+=(--moe-token-dispatcher-type alltoall) ;;
    uccl_ep_sfd*) extra+=(--moe-token-dispatcher-type uccl_ep --moe-uccl-ep-sync-free) ;;
    uccl_ep_sf*) extra+=(--moe-token-dispatcher-type uccl_ep --moe-uccl-ep-capacity-factor 1.25) ;;
    uccl_ep*) extra+=(--moe-token-dispatcher-type uccl_ep) ;;
    flex*)
      python3 -c "import sys; sys.path.insert(0, '$DEEPEP'); import deep_ep" 2> /dev/null \
        || { echo "$run: skipped (DeepEP V1 does not import)"; continue; }
      extra+=(--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep)
      env_run+=(PYTHONPATH="$DEEPEP${PYTHONPATH:+:$PYTHONPATH}") ;;
  esac
  [ "${METRICS:-0}" = 1 ] && extra+=(--moe-uccl-ep-metrics)
  # FP8 dispatch (per-128-channel scales, dequantized into the grouped bf16 experts)
  [[ $run == uccl_ep*_fp8* ]] && extra+=(--moe-uccl-ep-fp8-dispatch)
  if [[ $run == *_ov ]]; then
    extra+=(--overlap-moe-expert-parallel-comm)
    env_run=(CUDA_DEVICE_MAX_CONNECTIONS=32 "${env_run[@]:1}")
  fi
  if [[ $run == *_vn ]]; then  # the internode path: 2 virtual nodes, a 400 Gb/s NIC model each
    env_run+=(UCCL_EP_RANKS_PER_NODE=$((GPUS / 2)) UCCL_EP_TRANSPORT=ipc UCCL_EP_IPC_LINK_GBPS=50
      UCCL_EP_IPC_LATENCY_US=3)
  fi
  # shellcheck disable=SC2206  # the flag lists split on whitespace
  cmd=(torchrun --standalone --nproc-per-node "$GPUS" -m uccl_ep_megatron.run pretrain_gpt.py
    $MODEL $TRAINING $NO_TE "${extra[@]}")
  s=$SECONDS
  env "${env_run[@]}" timeout 300 "${cmd[@]}" > "$OUT/pretrain-$run.log" 2>&1
  r=$?
  echo "$run: rc=$r, $((SECONDS - s)) s"
  [ $r -eq 0 ] || { rc=1; grep -E "Error|error:" "$OUT/pretrain-$run.log" | tail -5; }
  echo "${env_run[*]} ${cmd[*]}" > "$OUT/pretrain-$run.cmd"
done
python3 - "$OUT" "$WARMUP" "$RUNS" "$((GBS * SEQ))" <<'PY'
import json, os, re, statistics, sys
out, warmup, runs, tokens = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), int(sys.argv[4])
line = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+) \|"
                  r".*?lm loss: ([\d.Ee+-]+) \|")
metrics_line = re.compile(r"^uccl_ep metrics \| iteration (\d+) \| (.*)$", re.M)
EXCHANGE = ("dispatch_time_ms", "combine_time_ms", "dispatch_backward_time_ms",
            "combine_backward_time_ms")
PERMUTE = ("permute_time_ms", "permute_backward_time_ms")
result = {"runs": {}}
for run in runs:
    log = os.path.join(out, f"pretrain-{run}.log")
    if not os.path.exists(log):
        continue
    text = open(log).read()
    command = open(os.path.join(out, f"pretrain-{run}.cmd")).read().strip()
    rows = [(int(i), float(ms), float(loss)) for i, ms, loss in line.findall(text)]
    if not rows:
        # The first rank's exception, not the launcher's ChildFailedError after it.
        errors = [x for x in text.splitlines()
                  if re.search(r"\w(Error|Exception): ", x) and "ChildFailedError" not in x]
        result["runs"][run] = {"command": command, "error": errors[0][:2000] if errors
                               else "no iteration lines"}
        continue
    ms = statistics.median(r[1] for r in rows[warmup:]) if len(rows) > warmup else None
    result["runs"][run] = {
        "command": command, "iterations": len(rows), "median_iteration_ms": ms,
        "tokens_per_s": tokens / (ms / 1e3) if ms else None,
        "iteration_ms": [r[1] for r in rows], "loss": [r[2] for r in rows]}
    # --moe-uccl-ep-metrics: the last rank's exchange time per iteration (forward + backward
    # dispatch and combine over every MoE layer and micro-batch) and the dispatcher's
    # permutation around it (forward + backward), when timed.
    per_iter, permute_iter = {}, {}
    for it, fields in metrics_line.findall(text):
        values = dict(f.rsplit(" ", 1) for f in fields.split(" | "))
        if all(k in values for k in EXCHANGE):
            per_iter[int(it)] = sum(float(values[k]) for k in EXCHANGE)
        if all(k in values for k in PERMUTE):
            permute_iter[int(it)] = sum(float(values[k]) for k in PERMUTE)

    def steady_median(d):
        steady = [v for i, v in sorted(d.items()) if i > warmup]
        return statistics.median(steady or list(d.values()))

    if per_iter:
        ex = steady_median(per_iter)
        result["runs"][run]["exchange_ms_per_iteration"] = per_iter
        result["runs"][run]["median_exchange_ms"] = ex
        if permute_iter:
            result["runs"][run]["permute_ms_per_iteration"] = permute_iter
            result["runs"][run]["median_permute_ms"] = steady_median(permute_iter)
            ex += result["runs"][run]["median_permute_ms"]
        if ms and ms > ex:
            result["runs"][run]["zero_cost_dispatcher_speedup"] = ms / (ms - ex)
base = result["runs"].get("alltoall", {}).get("loss")
for name, r in result["runs"].items():
    if base and r.get("loss") and len(r["loss"]) == len(base):
        r["max_abs_loss_diff_vs_alltoall"] = max(abs(a - b) for a, b in zip(base, r["loss"]))
json.dump(result, open(os.path.join(out, "pretrain-gpt.json"), "w"), indent=1)
ref = {k: result["runs"].get(k, {}).get("median_iteration_ms") for k in ("alltoall", "flex")}
for name, r in result["runs"].items():
    ms = r.get("median_iteration_ms")
    if not ms:
        print(f"{name:14} {r.get('error', 'incomplete')[:300]}")
        continue
    vs = "  ".join(f"vs {k} {ref[k] / ms:.3f}" for k in ref if ref[k])
    ex, perm = r.get("median_exchange_ms"), r.get("median_permute_ms")
    exchange = ""
    if ex and "zero_cost_dispatcher_speedup" in r:
        exchange = (f"  exchange {ex:.1f}" + (f" + permute {perm:.1f}" if perm else "")
                    + f" ms (zero-cost bound {r['zero_cost_dispatcher_speedup']:.3f}x)")
    print(f"{name:14} {ms:8.1f} ms/iter {r['tokens_per_s']:9,.0f} tok/s  {vs}  loss "
          f"{r['loss'][0]:.4f} -> {r['loss'][-1]:.4f}  "
          f"max diff {r.get('max_abs_loss_diff_vs_alltoall', float('nan')):.4f}{exchange}")
PY
exit $rc
