#!/usr/bin/env bash
# Reproduce one row of Table 2 of "Attention Is All You Need" on WMT14:
#   download -> prepare -> train -> average -> evaluate newstest2014.
#
# Every stage is idempotent, so after an interruption run the same command again:
# download and prepare skip what is complete, training resumes from its newest
# checkpoint, averaging and evaluation are cheap and simply run again.
#
# Outputs go under the current directory: data/wmt14_en_xx, prepared/wmt14_en_xx, runs/wmt14_en_xx_SIZE.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: scripts/reproduce_wmt14.sh PAIR SIZE [NGPUS]

  PAIR   en-de or en-fr
  SIZE   base or big
  NGPUS  GPUs on this host (default 1); train.update_freq is set to 8/NGPUS so an
         update keeps the paper's ~25k source + 25k target tokens (3125 x update_freq x NGPUS)

A checkpoint is kept every 1500 (base) or 600 (big) updates, the paper's 10 minutes at its
pace, so that averaging the last 5 or 20 covers the same stretch of training on any GPU.
The script stops before downloading anything unless PyTorch sees NGPUS CUDA GPUs.

examples:
  scripts/reproduce_wmt14.sh en-de base 8     # Table 2: 27.3 BLEU, ~100k updates
  scripts/reproduce_wmt14.sh en-fr big 8      # Table 2: 41.8 BLEU, 300k updates
EOF
    stage_env_help
}

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/common.sh
. "$ROOT/scripts/common.sh"
check_usage 2 3 "$@"
PAIR=$1
SIZE=$2
NGPUS=${3:-1}
PYTHON=${PYTHON:-python}

# SAVE_EVERY: the paper's checkpoint every 10 minutes in updates at its pace (base 0.4 s, big 1.0 s per step).
case "$PAIR/$SIZE" in
    en-de/base) CONFIG=$ROOT/configs/base.yaml; PAPER_BLEU=27.3; SAVE_EVERY=1500 ;;
    en-de/big) CONFIG=$ROOT/configs/big.yaml; PAPER_BLEU=28.4; SAVE_EVERY=600 ;;
    en-fr/base) CONFIG=$ROOT/configs/en-fr-base.yaml; PAPER_BLEU=38.1; SAVE_EVERY=1500 ;;
    en-fr/big) CONFIG=$ROOT/configs/en-fr-big.yaml; PAPER_BLEU=41.8; SAVE_EVERY=600 ;;
    *)
        echo "error: unknown PAIR/SIZE '$PAIR/$SIZE'; PAIR is en-de or en-fr, SIZE is base or big" >&2
        exit 2
        ;;
esac
check_gpus "$NGPUS"
require_gpus "$NGPUS"
set_update_freq "$NGPUS"
read_stage_args
# before TRAIN_ARGS, which may override it
train_args=(--set train.save_every_minutes=0 --set "train.save_every_updates=$SAVE_EVERY" "${train_args[@]}")

# Where the config puts things (one source of truth: the YAML file).
read -r DATA_DIR RUN_DIR AVERAGE_LAST < <("$PYTHON" -c '
import os, sys
from transformer_mt.config import load_config
cfg = load_config(sys.argv[1])
print(os.path.dirname(cfg.data.train), cfg.train.save_dir, cfg.train.average_last)
' "$CONFIG")

stage "1/5 download WMT14 $PAIR -> $DATA_DIR"
tmt download wmt14 --pair "$PAIR" --out "$DATA_DIR" "${download_args[@]}"

stage "2/5 prepare (clean, joint BPE, binarize) -> $CONFIG"
tmt prepare "$CONFIG" "${prepare_args[@]}"

stage "3/5 train on $NGPUS GPU(s), update_freq $UPDATE_FREQ -> $RUN_DIR (resumes if interrupted)"
train_on_gpus "$CONFIG" "$NGPUS"

stage "4/5 average the last $AVERAGE_LAST checkpoints -> $RUN_DIR/average.pt"
tmt average "$RUN_DIR" --last "$AVERAGE_LAST" -o "$RUN_DIR/average.pt"

# The local newstest2014 files are sacreBLEU's wmt14/full text (written by `tmt download`), so this
# works offline and scores exactly what `tmt evaluate newstest2014` would fetch.
stage "5/5 evaluate newstest2014 (beam 4, length penalty 0.6) -> $RUN_DIR/eval"
tmt evaluate newstest2014 -c "$RUN_DIR/average.pt" -o "$RUN_DIR/eval" --beam 4 --lenpen 0.6 \
    --src "$DATA_DIR/newstest2014.${PAIR%-*}" --ref "$DATA_DIR/newstest2014.${PAIR#*-}"

echo "paper (Table 2, tokenized BLEU): $PAIR $SIZE $PAPER_BLEU; scores above and in $RUN_DIR/eval" >&2
