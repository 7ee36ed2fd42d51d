#!/usr/bin/env bash
# evaluate.sh: perplexity of a model on the validation split, then a generated sample.
#
# Usage: [VAR=value ...] bash pipelines/evaluate.sh [more `dsgpt2 evaluate` flags]
#
# Settings (environment variables, with defaults):
#   CONFIG          connection config of the corpus                     configs/mongo.json
#   MODEL_DIR       exported model (dsgpt2 export) or checkpoint dir    runs/model
#   SPLIT           val, train or all                                   val
#   REPORT          JSON report to write                                runs/eval/report.json
#   MAX_BATCHES     evaluate at most this many batches                  (all)
#   PROMPT          prompt of the generated sample                      "The"
#   MAX_NEW_TOKENS  tokens of the sample                                48
#   SEED            seed of the sample                                  0
#   SAMPLE_OUT      file the sample is written to                       runs/eval/sample.txt
# The result is also recorded in the eval_results collection of the database.
set -euo pipefail
# shellcheck source=pipelines/_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
if script_help "$@"; then
  echo
  exec dsgpt2 evaluate --help  # the flags it passes on; no evaluation, no sample written
fi

CONFIG="${CONFIG:-configs/mongo.json}"
MODEL_DIR="${MODEL_DIR:-runs/model}"
SPLIT="${SPLIT:-val}"
REPORT="${REPORT:-runs/eval/report.json}"
MAX_BATCHES="${MAX_BATCHES:-}"
PROMPT="${PROMPT:-The}"
MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-48}"
SEED="${SEED:-0}"
SAMPLE_OUT="${SAMPLE_OUT:-runs/eval/sample.txt}"

# The sample's settings checked before the evaluation, not found wrong after it.
if ! [[ "$MAX_NEW_TOKENS" =~ ^[0-9]+$ && "$MAX_NEW_TOKENS" -ge 1 ]]; then
  echo "evaluate.sh: MAX_NEW_TOKENS must be a whole number of at least 1, got '$MAX_NEW_TOKENS'" >&2
  exit 2
fi
if ! [[ "$SEED" =~ ^[0-9]+$ ]]; then
  echo "evaluate.sh: SEED must be a whole number of at least 0, got '$SEED'" >&2
  exit 2
fi

args=(evaluate --model "$MODEL_DIR" --config "$CONFIG" --split "$SPLIT" --report "$REPORT")
if [[ -n "$MAX_BATCHES" ]]; then
  args+=(--max_batches "$MAX_BATCHES")
fi
dsgpt2 "${args[@]}" "$@"

mkdir -p "$(dirname "$SAMPLE_OUT")"
# Written beside its place and moved there whole: a failed generation leaves the sample before it.
sample="$(mktemp "$(dirname "$SAMPLE_OUT")/.sample.XXXXXX")"
trap 'rm -f "$sample"' EXIT
dsgpt2 generate --model "$MODEL_DIR" --max_new_tokens "$MAX_NEW_TOKENS" --seed "$SEED" "$PROMPT" \
  | tee "$sample"
chmod "$(printf '%o' $((0666 & ~$(umask))))" "$sample"
mv "$sample" "$SAMPLE_OUT"
