#!/usr/bin/env bash
# The Space's entrypoint: GRPO training of the Pi agent, everything in this container.
#   GPU 0          vLLM (dev mode, processed log-probs, LoRA and NCCL weight sync), on 127.0.0.1 only
#   GPUs 1..N-1    the trainer: `accelerate launch examples/train.py --config CONFIG`; its rank 0 runs the
#                  rollout worker and the InterceptionServer on 0.0.0.0:7860 (the Space's app_port)
#   HF Jobs        one sandbox per agent run and per grading (`sandbox: hf`); agents call back through the
#                  Space's public URL, each rollout with its own token. HF cannot cut a sandbox's network, so
#                  grading's sandboxes keep HF's: `--hf_accept_network` says so (without it grading is refused)
# The trainer starts once vLLM is healthy. SIGTERM (the Space stopping) stops both, then the script exits.
# When training ends (or fails), vLLM is stopped and the Space pauses itself unless SWE_GRPO_PAUSE_WHEN_DONE=0:
# a finished run should neither keep the GPUs billing nor, restarted, train again from scratch.
#
# Secrets come from the environment only (Space secrets): HF_TOKEN (sandboxes, model download, pushes, the
# pause). Settings (Space variables, all optional): SWE_GRPO_CONFIG, SWE_GRPO_ACCELERATE_CONFIG,
# SWE_GRPO_OUTPUT_DIR, SWE_GRPO_PORT, PUBLIC_BASE_URL (default https://$SPACE_HOST), VLLM_PORT, VLLM_MAX_MODEL_LEN,
# VLLM_GPU_MEMORY_UTILIZATION, VLLM_STARTUP_TIMEOUT_S, STOP_GRACE_S.
set -euo pipefail

APP=${SWE_GRPO_APP_DIR:-/opt/swe_grpo/app}
CONFIG=${SWE_GRPO_CONFIG:-$APP/space_app/config.yaml}
PORT=${SWE_GRPO_PORT:-7860}  # must stay the README front-matter's app_port inside a Space
VLLM_PORT=${VLLM_PORT:-8000}
VLLM_URL="http://127.0.0.1:$VLLM_PORT"
VLLM_STARTUP_TIMEOUT_S=${VLLM_STARTUP_TIMEOUT_S:-1800}
STOP_GRACE_S=${STOP_GRACE_S:-20}
export VLLM_PORT

log() { printf '[start.sh %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() {
    log "error: $*"
    exit 1
}

# ----------------------------------------------------------------------------- preconditions
if [[ -z ${PUBLIC_BASE_URL:-} ]]; then
    [[ -n ${SPACE_HOST:-} ]] ||
        die "SPACE_HOST is not set (outside a Space, set PUBLIC_BASE_URL: where sandboxes reach port $PORT)"
    PUBLIC_BASE_URL="https://$SPACE_HOST"
fi
[[ -n ${HF_TOKEN:-} ]] || die "the HF_TOKEN secret is not set: HF Jobs sandboxes need it (Space settings > secrets)"
[[ -f $CONFIG ]] || die "no training config at $CONFIG"
command -v nvidia-smi >/dev/null || die "no NVIDIA GPU visible (nvidia-smi missing): this Space needs GPU hardware"
num_gpus=$(nvidia-smi --list-gpus | grep -c '^GPU ' || true)
((num_gpus >= 2)) || die "found $num_gpus GPU(s); vLLM takes GPU 0 and training needs at least one more"
trainer_gpus=$(seq -s, 1 $((num_gpus - 1)))

# Persistent storage (/data, when the Space has it) keeps the model cache and checkpoints across restarts.
if [[ -d /data && -w /data ]]; then
    export HF_HOME=${HF_HOME:-/data/huggingface}
    OUTPUT_DIR=${SWE_GRPO_OUTPUT_DIR:-/data/swe_grpo/output}
else
    OUTPUT_DIR=${SWE_GRPO_OUTPUT_DIR:-$HOME/swe_grpo/output}
fi
mkdir -p "$OUTPUT_DIR"

# ----------------------------------------------------------------------------- process groups
# Each server runs in its own session (setsid), so stopping it reaches the processes it spawned too (vLLM's
# engine core, accelerate's ranks).
pids=()

stop_all() {
    local pid deadline=$((SECONDS + STOP_GRACE_S))
    for pid in "${pids[@]}"; do
        kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        while kill -0 -- "-$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
        kill -KILL -- "-$pid" 2>/dev/null || true
    done
    pids=()
}

# shellcheck disable=SC2317  # called by the trap below, which shellcheck does not follow
on_signal() {
    log "stopping (signal)"
    stop_all
    exit 143
}
trap on_signal TERM INT
trap stop_all EXIT

# ----------------------------------------------------------------------------- vLLM on GPU 0
vllm_args_text=$(python "$APP/space_app/vllm_command.py" "$CONFIG")
mapfile -t vllm_args <<<"$vllm_args_text"
log "vLLM on GPU 0: vllm ${vllm_args[*]}"
CUDA_VISIBLE_DEVICES=0 VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 \
    setsid python -m vllm.entrypoints.cli.main "${vllm_args[@]}" </dev/null &
vllm_pid=$!
pids+=("$vllm_pid")

healthy() { python -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' "$1" 2>/dev/null; }
deadline=$((SECONDS + VLLM_STARTUP_TIMEOUT_S))
until healthy "$VLLM_URL/health"; do
    kill -0 "$vllm_pid" 2>/dev/null || die "vLLM exited during start-up (its log is above)"
    ((SECONDS < deadline)) || die "vLLM not healthy after ${VLLM_STARTUP_TIMEOUT_S}s"
    sleep 2
done
log "vLLM healthy at $VLLM_URL"

# ----------------------------------------------------------------------------- the trainer on GPUs 1..N-1
# Through this venv's python: accelerate starts the ranks with its own interpreter, and a base image's
# `accelerate` script would bring the base's Python, which lacks this package.
launch=(python -m accelerate.commands.launch --num_machines 1)
launch+=(--num_processes $((num_gpus - 1)) --gpu_ids "$trainer_gpus")
if [[ -n ${SWE_GRPO_ACCELERATE_CONFIG:-} ]]; then
    # Relative to the app, e.g. examples/accelerate/fsdp2.yaml; the two flags above override its GPU choice.
    launch+=(--config_file "$APP/$SWE_GRPO_ACCELERATE_CONFIG")
elif ((num_gpus > 2)); then
    launch+=(--multi_gpu)
fi
log "trainer on GPUs $trainer_gpus; InterceptionServer on 0.0.0.0:$PORT, public at $PUBLIC_BASE_URL"
CUDA_VISIBLE_DEVICES=$trainer_gpus setsid "${launch[@]}" "$APP/examples/train.py" \
    --config "$CONFIG" \
    --output_dir "$OUTPUT_DIR" \
    --vllm_server_base_url "$VLLM_URL" \
    --sandbox hf \
    --hf_accept_network true \
    --interception_host 0.0.0.0 \
    --interception_port "$PORT" \
    --public_base_url "$PUBLIC_BASE_URL" </dev/null &
trainer_pid=$!
pids+=("$trainer_pid")

# ----------------------------------------------------------------------------- until one of them ends
status=0 ended=""
wait -n -p ended "$vllm_pid" "$trainer_pid" || status=$?
if [[ $ended == "$vllm_pid" ]]; then
    log "vLLM exited (status $status) during training; stopping the trainer"
    status=1
else
    log "trainer exited (status $status); checkpoints and the final model are in $OUTPUT_DIR"
fi
stop_all

if [[ ${SWE_GRPO_PAUSE_WHEN_DONE:-1} == 1 && -n ${SPACE_ID:-} ]]; then
    log "pausing the Space $SPACE_ID (restart it from its settings page)"
    # The token is read from HF_TOKEN by huggingface_hub, never passed as an argument.
    python -c 'import sys; from huggingface_hub import HfApi; HfApi().pause_space(sys.argv[1])' "$SPACE_ID" \
        || log "could not pause the Space; stop it by hand or it keeps billing"
fi
exit "$status"
