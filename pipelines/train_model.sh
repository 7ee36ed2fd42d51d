#!/usr/bin/env bash
# train_model.sh: train GPT-2 with DeepSpeed on the MongoDB corpus.
#
# Usage: [VAR=value ...] bash pipelines/train_model.sh [more ds_trainer.py flags]
#
# Settings (environment variables, with defaults):
#   CONFIG        connection config                               configs/mongo.json
#   TOKENIZER     tokenizer directory (train_vocab.sh)            runs/tokenizer
#   DS_CONFIG     DeepSpeed config (see `dsgpt2 plan`)            configs/ds_config.json
#   MODEL         model preset: tiny 112m_half 112m 345m ...      112m
#   TRAIN_ITERS   optimizer steps                                 1000
#   TR_RATIO      share of documents that train                   0.99
#   SEED          seed of init, split and data order              1234
#   CKPT_DIR      checkpoints (resumed from when present)         runs/ckpt
#   WORKSPACE     metrics, loss plot, wandb                       runs/train
#   DATA_MODE     streaming or cached                             streaming
#   LAUNCHER      "deepspeed" (via dsgpt2 launch) or "python"     deepspeed
#   NUM_GPUS      GPUs per node for the deepspeed launcher        (all visible)
#   HOSTFILE      DeepSpeed hostfile for several nodes            (single node)
#
# A new run trains with Muon (the blocks' matrices; AdamW on the rest) under a WSD schedule; a resumed
# one with its checkpoint's optimizer. AdamW alone: add --optimizer adamw.
set -euo pipefail
# shellcheck source=pipelines/_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
if script_help "$@"; then
  echo
  exec python "$project_root/ds_trainer.py" --help  # the flags it passes on; no launcher started
fi

CONFIG="${CONFIG:-configs/mongo.json}"
TOKENIZER="${TOKENIZER:-runs/tokenizer}"
DS_CONFIG="${DS_CONFIG:-configs/ds_config.json}"
MODEL="${MODEL:-112m}"
TRAIN_ITERS="${TRAIN_ITERS:-1000}"
TR_RATIO="${TR_RATIO:-0.99}"
SEED="${SEED:-1234}"
CKPT_DIR="${CKPT_DIR:-runs/ckpt}"
WORKSPACE="${WORKSPACE:-runs/train}"
DATA_MODE="${DATA_MODE:-streaming}"
LAUNCHER="${LAUNCHER:-deepspeed}"
NUM_GPUS="${NUM_GPUS:-}"
HOSTFILE="${HOSTFILE:-}"

args=(--deepspeed_config "$DS_CONFIG" --config_train "$CONFIG" --vocab_dir "$TOKENIZER"
  --model_select "$MODEL" --train_iters "$TRAIN_ITERS" --tr_ratio "$TR_RATIO" --seed "$SEED"
  --ckpt_dir "$CKPT_DIR" --workspace "$WORKSPACE" --data_mode "$DATA_MODE")

if [[ "$LAUNCHER" != "deepspeed" && "$LAUNCHER" != "python" ]]; then
  echo "train_model.sh: LAUNCHER must be deepspeed or python, got '$LAUNCHER'" >&2
  exit 2
fi
if [[ "$LAUNCHER" == "python" ]]; then
  exec python "$project_root/ds_trainer.py" "${args[@]}" "$@"
fi
# The deepspeed launcher through `dsgpt2 launch`: Ctrl-C or SIGTERM to this script's group ends it as a
# single process ends (every rank saves, exit 0) instead of the launcher's own 130/143 mid-save.
launcher=(dsgpt2 launch)
if [[ -n "$HOSTFILE" ]]; then
  launcher+=(--hostfile "$HOSTFILE")
fi
if [[ -n "$NUM_GPUS" ]]; then
  launcher+=(--num_gpus "$NUM_GPUS")
fi
exec "${launcher[@]}" "$project_root/ds_trainer.py" "${args[@]}" "$@"
