#!/usr/bin/env bash
# The GPU bring-up checks of docs/gpu.md, one command per part, logs under OUT.
#
#   OUT=/tmp/gpu-out bash scripts/gpu_checks.sh [env] [tests] [job] [probe] [bench]
#
# No part given: all of them, in that order. Each part has its own time limit so that one
# hang does not eat the others; every log goes to $OUT/<part>.txt and the run directories
# (metrics, fingerprints, parity tables) to $OUT/runs.tar.gz. Runs from the repository root
# with crossrl importable (an installed checkout, or PYTHONPATH=$PWD plus the offline bundle).
set -uo pipefail
OUT=${OUT:?set OUT to a folder for the logs}
mkdir -p "$OUT"
WORK=${CROSSRL_GPU_WORK:-/tmp/crossrl-gpu}
RUNS=$WORK/runs
MODEL=$WORK/qwen2.5-0.5b-random
mkdir -p "$RUNS"
PY=${PYTHON:-python3}
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(env tests job probe bench)

crossrl() { "$PY" -m trainer.cli "$@"; }

part_env() {
    nvidia-smi
    "$PY" - <<'EOF'
import platform, torch, transformers, ray, pydantic
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "transformers", transformers.__version__, "ray", ray.__version__,
      "pydantic", pydantic.__version__)
EOF
    crossrl devices
}

part_tests() {
    # The whole suite; the cuda-marked tests must run here, not skip (-rs lists every skip).
    "$PY" -m pytest -q -rs -p no:cacheprovider --timeout 120 --durations 15 tests
}

part_job() {
    # Five steps of the 0.5B GRPO job at dp 1 with the HF engine: random weights in
    # Qwen2.5-0.5B's shape, bf16 compute, fp32 master weights, activation checkpointing.
    [ -d "$MODEL" ] || "$PY" -m rollout.models random qwen2.5-0.5b "$MODEL" --seed 0
    crossrl train --config configs/gpu/qwen2.5-0.5b-grpo.yaml \
        model.path="$MODEL" rollout.engine=hf train.dp_size=1 train.total_steps=5 \
        train.batch_size=16 train.mini_batch_size=8 rollout.n=4 rollout.max_turns=2 \
        rollout.max_input_len=1024 rollout.max_new_tokens=256 \
        train.max_tokens_per_micro_batch=16384 train.warmup_steps=2 run.save_every=0 \
        run.resume=never \
        run.dir="$RUNS/job-0.5b"
    "$PY" scripts/summarize_run.py "$RUNS/job-0.5b"
}

part_probe() {
    # The CPU fp32 golden rollouts replayed on cuda in fp32 and in bf16, then compared.
    for dtype in float32 bfloat16; do
        crossrl probe --config tests/golden/tiny_cpu_fp32/config.yaml \
            --rollouts tests/golden/tiny_rollouts --steps 3 --out "$RUNS/probe-cuda-$dtype" \
            device=cuda train.param_dtype=$dtype
        crossrl parity tests/golden/tiny_cpu_fp32 "$RUNS/probe-cuda-$dtype" \
            | tee "$RUNS/probe-cuda-$dtype/parity.txt"
    done
}

part_bench() {
    crossrl bench gpu --out "$RUNS/bench-gpu.json"
}

declare -A limit=([env]=60 [tests]=${TESTS_LIMIT_S:-420} [job]=240 [probe]=150 [bench]=200)
for part in "${parts[@]}"; do
    echo "=== $part (limit ${limit[$part]} s) $(date -u +%FT%TZ)" | tee -a "$OUT/summary.txt"
    start=$(date +%s)
    ( export -f crossrl "part_$part"; export PY MODEL RUNS
      timeout "${limit[$part]}" bash -c "part_$part" ) > "$OUT/$part.txt" 2>&1
    rc=$?
    echo "=== $part rc=$rc in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
    tail -n 25 "$OUT/$part.txt"
done
tar -C "$WORK" --exclude='checkpoints' --exclude='rollouts' -czf "$OUT/runs.tar.gz" runs
