#!/usr/bin/env bash
# One GPU, about 8 minutes (485 s of time limits): what the GPU path of tmt does, in one table.
#
#   benchmarks/gpu_check.sh                 # on a machine with a CUDA device, from the repository root
#   benchmarks/gpu_check.sh --cpu-smoke     # tiny shapes on the CPU: checks this script, measures nothing
#   PYTHON=.venv/bin/python benchmarks/gpu_check.sh   # an interpreter with torch (default: python, else python3)
#
# Reports, each part bounded in time:
#   - base and big (configs/base.yaml, big.yaml, vocabulary 37000) in bf16, eager and compiled
#     (train.compile with train.pad_to_multiple=8): target tokens/s, MFU, peak memory
#     (benchmarks/train_throughput.py --impl tmt, synthetic batches of train.max_tokens);
#   - a few updates (5 timed) through DDP over NCCL, one process (torchrun --nproc-per-node 1);
#   - beam-4 decoding of newstest2014 (wmt14_en_de/ under ../shared/data or shared/data), sentences/s;
#   - `tmt quickstart` with training on the GPU: the trainer's own loop end to end, and the BLEU it reaches.
# Figures go to stdout and, with $OUT set, to $OUT/gpu_check/ (one JSON per part and gpu_check.md).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python || command -v python3 || echo python)}  # some systems have python3 alone
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # transformer_mt from this checkout, installed or not
SMOKE=0
if [[ ${1:-} == --cpu-smoke ]]; then SMOKE=1; elif [[ $# -gt 0 ]]; then
    echo "usage: benchmarks/gpu_check.sh [--cpu-smoke]" >&2; exit 2
fi
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "gpu_check: $PYTHON cannot import torch; activate the project's virtual environment" >&2
    echo "gpu_check: or name its interpreter: PYTHON=.venv/bin/python benchmarks/gpu_check.sh" >&2
    exit 2
fi
if [[ $SMOKE == 0 ]] && ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing measured." >&2
    echo "gpu_check: run it on a GPU machine, or check the script itself with --cpu-smoke" >&2
    exit 2
fi
DATA=""
for dir in ../shared/data shared/data; do
    if [[ -f $dir/wmt14_en_de/newstest2014.en ]]; then DATA=$dir; break; fi
done
RESULTS=${OUT:+$OUT/gpu_check}
RESULTS=${RESULTS:-$(mktemp -d)}
mkdir -p "$RESULTS"
START=$SECONDS

# part NAME SECONDS COMMAND...: run one part under a time limit; a part that fails or overruns is named, not fatal.
part() {
    local name=$1 limit=$2; shift 2
    echo "== $name (at most ${limit}s)" >&2
    if ! timeout --signal=TERM --kill-after=10 "$limit" "$@" >&2; then
        echo "gpu_check: $name failed or ran out of its ${limit}s" >&2
        echo "{\"part\": \"$name\", \"error\": \"failed or ran out of ${limit}s\"}" > "$RESULTS/$name.json"
    fi
}

if [[ $SMOKE == 1 ]]; then
    SHAPE=(--set model.d_model=32 --set model.d_ff=64 --set model.heads=2 --set model.encoder_layers=1
           --set model.decoder_layers=1 --set bpe.vocab_size=500 --set train.max_tokens=512)
    STEPS=(--steps 2 --warmup 1 --max-seconds 10)
    SMOKE_FLAG=(--cpu-smoke)
    DECODE=(--cpu-smoke --sentences 20 --seconds 20)
    TRAIN_LIMIT=120 COMPILE_LIMIT=300 DDP_LIMIT=120 DECODE_LIMIT=120 QUICKSTART_LIMIT=120
else
    # 35 + 135 per model, 30 for DDP, 40 for decoding, 75 for the quickstart: 485 s of limits, about 8 minutes.
    # A compiled part builds two graphs in its warm-up (the first batch's shapes, then one with dynamic
    # dimensions), each perhaps tens of seconds for these models, so it gets the most.
    SHAPE=(--set train.max_tokens=12500)
    STEPS=(--steps 20 --warmup 3 --max-seconds 12)
    SMOKE_FLAG=()
    DECODE=(--seconds 25)
    TRAIN_LIMIT=35 COMPILE_LIMIT=135 DDP_LIMIT=30 DECODE_LIMIT=40 QUICKSTART_LIMIT=75
fi
for model in base big; do
    common=("configs/$model.yaml" --impl tmt --repeats 1 "${STEPS[@]}" "${SHAPE[@]}" --set train.precision=bf16)
    part "train_${model}_eager" "$TRAIN_LIMIT" \
        "$PYTHON" benchmarks/train_throughput.py "${common[@]}" --json "$RESULTS/train_${model}_eager.json"
    part "train_${model}_compiled" "$COMPILE_LIMIT" \
        "$PYTHON" benchmarks/train_throughput.py "${common[@]}" --warmup 6 --set train.compile=true \
        --set train.pad_to_multiple=8 --json "$RESULTS/train_${model}_compiled.json"
done
part ddp "$DDP_LIMIT" "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 \
    benchmarks/gpu_check.py ddp "${SMOKE_FLAG[@]}" --json "$RESULTS/ddp.json"
if [[ -n $DATA ]]; then
    part decode "$DECODE_LIMIT" "$PYTHON" benchmarks/gpu_check.py decode "${DECODE[@]}" --data "$DATA" \
        --json "$RESULTS/decode.json"
else
    echo "gpu_check: no wmt14_en_de/newstest2014.en under ../shared/data or shared/data; decoding not measured" >&2
fi
part quickstart "$QUICKSTART_LIMIT" "$PYTHON" benchmarks/gpu_check.py quickstart "${SMOKE_FLAG[@]}" \
    --json "$RESULTS/quickstart.json"

{
    echo "# gpu_check: $("$PYTHON" -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU (smoke)')"), torch $("$PYTHON" -c "import torch; print(torch.__version__)"), $((SECONDS - START)) s"
    echo
    "$PYTHON" benchmarks/gpu_check.py report "$RESULTS"
} | tee "$RESULTS/gpu_check.md"
echo "figures in $RESULTS" >&2
