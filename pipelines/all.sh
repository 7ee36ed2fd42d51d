#!/usr/bin/env bash
# all.sh: the whole pipeline on the built-in sample corpus (or your own collections):
# ingest → vocab download → vocab train → train → export → evaluate and a generated sample.
#
# Usage: [VAR=value ...] bash pipelines/all.sh
#
# A stage whose output exists is skipped, so a re-run (after a crash, or with more TRAIN_ITERS)
# redoes no finished work; stage timings are printed at the end. SIGTERM reaches every process of the
# running stage (training ranks save a checkpoint) and the pipeline stops once they have exited.
#
# Settings (environment variables, with defaults):
#   CONFIG         connection config (password in MONGO_CONNECTION_STRING)  configs/sample.json
#   RUN_DIR        every output of the run                                  runs/pipeline
#   SAMPLE         built-in sample to ingest; empty: use what CONFIG holds   stdlib
#   SAMPLE_LIMIT   ingest only the first N sample documents                 (all)
#   VOCAB_SIZE     vocabulary size                                          8192
#   MODEL          model preset                                             tiny
#   TRAIN_ITERS    optimizer steps                                          300
#   TR_RATIO       share of documents that train                            0.95
#   DS_CONFIG      DeepSpeed config                                         configs/ds_config_cpu.json
#   LAUNCHER       python (one process) or deepspeed                        python
#   TRAIN_EXTRA    more ds_trainer.py flags, space-separated                (none)
#   PROMPT         prompt of the generated sample                           "The"
set -euo pipefail
# shellcheck source=pipelines/_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
if script_help "$@"; then
  exit 0
fi
if [[ $# -gt 0 ]]; then
  echo "all.sh: takes no arguments (settings are environment variables; see --help), got: $*" >&2
  exit 2
fi

CONFIG="${CONFIG:-configs/sample.json}"
RUN_DIR="${RUN_DIR:-runs/pipeline}"
SAMPLE="${SAMPLE-stdlib}"
SAMPLE_LIMIT="${SAMPLE_LIMIT:-}"
VOCAB_SIZE="${VOCAB_SIZE:-8192}"
MODEL="${MODEL:-tiny}"
TRAIN_ITERS="${TRAIN_ITERS:-300}"
TR_RATIO="${TR_RATIO:-0.95}"
DS_CONFIG="${DS_CONFIG:-configs/ds_config_cpu.json}"
LAUNCHER="${LAUNCHER:-python}"
TRAIN_EXTRA="${TRAIN_EXTRA:-}"
PROMPT="${PROMPT:-The}"
export CONFIG

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
stages="$RUN_DIR/stages"
mkdir -p "$stages"
timings=()
child=0
stopping=0

on_signal() {
  stopping=1
  if [[ "$child" -ne 0 ]]; then
    # The whole process group of the stage: a launcher does not always pass the signal on to its
    # ranks (DataLoader workers ignore it and stop with their rank).
    kill -TERM -- "-$child" 2>/dev/null || true
  fi
}
trap on_signal TERM INT

# stage NAME OUTPUT COMMAND...: run COMMAND unless OUTPUT exists; an OUTPUT under $stages is a
# marker left when the stage succeeds (its result lives in the database, or in several files).
stage() {
  local name="$1" output="$2"
  shift 2
  if [[ "$stopping" -eq 1 ]]; then
    echo "== stopped before $name; run again to continue" >&2
    exit 143
  fi
  if [[ -e "$output" ]]; then
    echo "== $name: done before ($output), skipped"
    timings+=("$(printf '%-14s %8s  %s' "$name" "skipped" "$output")")
    return 0
  fi
  echo "== $name"
  local start=$SECONDS rc=0
  # In its own process group, in the background: a signal interrupts `wait`, not the stage, which
  # gets the signal from on_signal and is waited for until every process of it has exited.
  setsid "$@" &
  child=$!
  while true; do
    rc=0
    wait "$child" || rc=$?
    if ! kill -0 "$child" 2>/dev/null; then
      break
    fi
  done
  while kill -0 -- "-$child" 2>/dev/null; do
    sleep 1
  done
  child=0
  timings+=("$(printf '%-14s %7ss  %s' "$name" "$((SECONDS - start))" "$output")")
  if [[ "$rc" -ne 0 && "$stopping" -eq 1 ]]; then
    echo "== stopped during $name; run again to continue" >&2
    exit 143
  fi
  if [[ "$rc" -ne 0 ]]; then
    echo "== $name failed (exit $rc)" >&2
    exit "$rc"
  fi
  if [[ "$output" == "$stages"/* ]]; then
    touch "$output"
  fi
  if [[ "$stopping" -eq 1 ]]; then
    echo "== stopped after $name; run again to continue" >&2
    exit 143
  fi
}

ingest_args=(ingest --config "$CONFIG" --sample "$SAMPLE" --no_progress)
if [[ -n "$SAMPLE_LIMIT" ]]; then
  ingest_args+=(--limit "$SAMPLE_LIMIT")
fi
if [[ -n "$SAMPLE" ]]; then
  stage ingest "$stages/ingest.done" dsgpt2 "${ingest_args[@]}"
fi

stage vocab-download "$stages/vocab-download.done" \
  env VOCAB_CORPUS="$RUN_DIR/vocab_corpus" bash "$here/download_vocab.sh" --no_progress

stage vocab-train "$RUN_DIR/tokenizer/tokenizer.json" \
  env VOCAB_CORPUS="$RUN_DIR/vocab_corpus" TOKENIZER="$RUN_DIR/tokenizer" VOCAB_SIZE="$VOCAB_SIZE" \
  bash "$here/train_vocab.sh" --no_progress

read -r -a train_extra <<< "$TRAIN_EXTRA"
stage train "$RUN_DIR/ckpt/global_step$TRAIN_ITERS/dsgpt2_complete.json" \
  env TOKENIZER="$RUN_DIR/tokenizer" DS_CONFIG="$DS_CONFIG" MODEL="$MODEL" TRAIN_ITERS="$TRAIN_ITERS" \
  TR_RATIO="$TR_RATIO" CKPT_DIR="$RUN_DIR/ckpt" WORKSPACE="$RUN_DIR/train" LAUNCHER="$LAUNCHER" \
  bash "$here/train_model.sh" "${train_extra[@]}"

# Per TRAIN_ITERS: a longer run is exported (over the shorter one's model) and evaluated again.
stage export "$stages/export-$TRAIN_ITERS.done" \
  dsgpt2 export --ckpt_dir "$RUN_DIR/ckpt" --out "$RUN_DIR/model" --overwrite

stage evaluate "$stages/evaluate-$TRAIN_ITERS.done" \
  env MODEL_DIR="$RUN_DIR/model" REPORT="$RUN_DIR/eval/report.json" SAMPLE_OUT="$RUN_DIR/eval/sample.txt" \
  PROMPT="$PROMPT" bash "$here/evaluate.sh" --no_progress

echo
echo "== stages"
printf '%s\n' "${timings[@]}"
echo "outputs: $RUN_DIR (model: $RUN_DIR/model, loss plot: $RUN_DIR/train/loss.png)"
