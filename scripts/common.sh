# Shared by the recipe scripts (sourced, not run): argument checks, the paper's tokens per update,
# the extra arguments each stage takes from the environment, and the training stage itself.

# stage_env_help: the environment variables every recipe script reads, the end of its usage text.
stage_env_help() {
    cat <<'EOF'

environment (optional):
  DOWNLOAD_ARGS   extra arguments for `tmt download`, e.g. "--source statmt" or "--from /data/wmt14"
  PREPARE_ARGS    extra arguments for `tmt prepare`, e.g. "--set data.workers=16"
  TRAIN_ARGS      extra arguments for `tmt train`, e.g. "--set train.max_minutes=600"
  PYTHON          the Python that has transformer_mt installed (default: python)
  ALLOW_CPU=1     go on without the GPUs (to try the pipeline; a real run would take months)
EOF
}

# check_usage MIN MAX ARGS...: -h/--help prints the caller's usage (exit 0); fewer than MIN or more than
# MAX arguments print it to stderr (exit 2).
check_usage() {
    local min=$1 max=$2
    shift 2
    if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
        usage
        exit 0
    fi
    if (($# < min || $# > max)); then
        usage >&2
        exit 2
    fi
}

# check_gpus NGPUS: exit 2 unless NGPUS is a positive integer and `tmt` is on PATH.
check_gpus() {
    if ! [[ "$1" =~ ^[1-9][0-9]*$ ]]; then
        echo "error: NGPUS must be a positive integer, got '$1'" >&2
        exit 2
    fi
    if ! command -v tmt >/dev/null; then
        echo "error: 'tmt' is not on PATH; install the package (pip install -e .) or activate its environment" >&2
        exit 2
    fi
}

# require_gpus NGPUS: exit 2, before anything is downloaded, unless $PYTHON's torch sees NGPUS CUDA GPUs;
# ALLOW_CPU=1 goes on anyway (to try the pipeline: a WMT14 row on CPUs would take months).
require_gpus() {
    local seen
    seen=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)') || seen=0
    if ((seen >= $1)); then
        return 0
    fi
    if [[ "${ALLOW_CPU:-}" == 1 ]]; then
        echo "warning: $PYTHON sees $seen CUDA GPU(s), not $1; going on because ALLOW_CPU=1" >&2
        return 0
    fi
    echo "error: $PYTHON sees $seen CUDA GPU(s) (torch.cuda.device_count()), but $1 are asked for; training a" \
        "WMT14 row without them would take months, so nothing was downloaded. Run on a host with $1 GPU(s)," \
        "pass the number it has, or set ALLOW_CPU=1 to go on anyway" >&2
    exit 2
}

# set_update_freq NGPUS: UPDATE_FREQ such that 3125 x UPDATE_FREQ x NGPUS is the paper's ~25k tokens per update
# (8 batches of 3125 tokens on 1 GPU = 1 batch on each of 8 GPUs); a warning when no whole number gives 25k.
set_update_freq() {
    local gpus=$1
    if ((8 % gpus == 0)); then
        UPDATE_FREQ=$((8 / gpus))
    else
        UPDATE_FREQ=$(((8 + gpus / 2) / gpus))
        ((UPDATE_FREQ >= 1)) || UPDATE_FREQ=1
        echo "warning: 8 is not a multiple of $gpus GPUs: $((3125 * UPDATE_FREQ * gpus)) tokens per update instead of 25000" >&2
    fi
}

# read_stage_args: the arrays download_args, prepare_args, train_args from DOWNLOAD_ARGS, PREPARE_ARGS, TRAIN_ARGS.
read_stage_args() {
    read -r -a download_args <<<"${DOWNLOAD_ARGS:-}"
    read -r -a prepare_args <<<"${PREPARE_ARGS:-}"
    read -r -a train_args <<<"${TRAIN_ARGS:-}"
}

# train_on_gpus CONFIG NGPUS: tmt train with the paper's tokens per update, under torchrun for several GPUs.
train_on_gpus() {
    if (($2 > 1)); then
        tmt train "$1" --nproc-per-node "$2" --set "train.update_freq=$UPDATE_FREQ" "${train_args[@]}"
    else
        tmt train "$1" --set "train.update_freq=$UPDATE_FREQ" "${train_args[@]}"
    fi
}

stage() { printf '\n=== %s ===\n' "$*" >&2; }
