#!/usr/bin/env bash
# Reproduce one row of Table 3 of "Attention Is All You Need" (model variations, English-German):
#   download -> prepare -> train configs/table3/ROW.yaml -> evaluate its last checkpoint on newstest2013.
#
# As the paper did for Table 3: the development set newstest2013, beam search as for Table 2 (beam 4,
# length penalty 0.6), and no checkpoint averaging. The dev perplexity is the run's last validation
# (newstest2013 is the configs' validation split), per BPE token as the paper's.
#
# Every stage is idempotent, so after an interruption run the same command again: download and
# prepare skip what is complete, training resumes from its newest checkpoint, evaluation runs again.
# The base and big rows are the runs of Table 2 (runs/wmt14_en_de_base, runs/wmt14_en_de_big): a run
# already trained by scripts/reproduce_wmt14.sh is only evaluated.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/common.sh
. "$ROOT/scripts/common.sh"
ROWS=$(cd "$ROOT/configs/table3" && ls -- *.yaml | sed 's/\.yaml$//' | paste -sd' ')

usage() {
    cat <<EOF
usage: scripts/table3.sh ROW [NGPUS]

  ROW    a row of Table 3, one of configs/table3/*.yaml:
         $ROWS
  NGPUS  GPUs on this host (default 1); train.update_freq is set to 8/NGPUS so an
         update keeps the paper's ~25k source + 25k target tokens (3125 x update_freq x NGPUS)

examples:
  scripts/table3.sh b_dk16 8     # Table 3 row (B), d_k 16: PPL 5.16, BLEU 25.1, 58M parameters
  scripts/table3.sh e_learned 8  # row (E), learned positions: PPL 4.92, BLEU 25.7

then, every row you ran beside the paper's figures:
  tmt report runs/table3/* runs/wmt14_en_de_* -o report.md
EOF
    stage_env_help
}

check_usage 1 2 "$@"
ROW=$1
NGPUS=${2:-1}
PYTHON=${PYTHON:-python}
CONFIG=$ROOT/configs/table3/$ROW.yaml

if [[ ! -f "$CONFIG" ]]; then
    echo "error: no Table 3 row '$ROW' (no $CONFIG); rows: $ROWS" >&2
    exit 2
fi
check_gpus "$NGPUS"
require_gpus "$NGPUS"
set_update_freq "$NGPUS"
read_stage_args

# Where the config puts things, and the paper's figures for the row (one source of truth each).
read -r DATA_DIR RUN_DIR PAPER < <("$PYTHON" -c '
import os, sys
from transformer_mt.config import load_config
from transformer_mt.paper import table3_row
cfg = load_config(sys.argv[1])
row = table3_row(cfg)
print(os.path.dirname(cfg.data.train), cfg.train.save_dir, f"PPL={row.ppl:.2f},BLEU={row.bleu},params={row.params}M")
' "$CONFIG")

stage "1/4 download WMT14 en-de -> $DATA_DIR"
tmt download wmt14 --pair en-de --out "$DATA_DIR" "${download_args[@]}"

stage "2/4 prepare (clean, joint BPE, binarize) -> $CONFIG"
tmt prepare "$CONFIG" "${prepare_args[@]}"

stage "3/4 train row $ROW on $NGPUS GPU(s), update_freq $UPDATE_FREQ -> $RUN_DIR (resumes if interrupted)"
train_on_gpus "$CONFIG" "$NGPUS"

LAST=$("$PYTHON" -c '
import sys
from transformer_mt.train.run_checkpoints import newest_readable
found = newest_readable(sys.argv[1], 1)
print(found[0] if found else "")
' "$RUN_DIR")
if [[ -z "$LAST" ]]; then
    echo "error: $RUN_DIR holds no readable checkpoint after training; see the training output above" >&2
    exit 1
fi

# The local newstest2013 files are sacreBLEU's text (written by `tmt download`), so this works offline.
stage "4/4 evaluate $LAST on newstest2013 (beam 4, length penalty 0.6, no averaging) -> $RUN_DIR/eval_newstest2013"
tmt evaluate newstest2013 -c "$LAST" -o "$RUN_DIR/eval_newstest2013" --beam 4 --lenpen 0.6 \
    --src "$DATA_DIR/newstest2013.en" --ref "$DATA_DIR/newstest2013.de"

tmt report "$RUN_DIR" -o "$RUN_DIR/report.md"
echo "paper (Table 3, row $ROW): ${PAPER//,/, }; this run beside it: $RUN_DIR/report.md" >&2
