#!/usr/bin/env bash
# train_vocab.sh: train the byte-level BPE tokenizer.
#
# Usage: [VAR=value ...] bash pipelines/train_vocab.sh [more `dsgpt2 vocab train` flags]
#
# Settings (environment variables, with defaults):
#   VOCAB_CORPUS   shards written by download_vocab.sh       runs/vocab_corpus
#   TOKENIZER      tokenizer directory to write              runs/tokenizer
#   VOCAB_SIZE     vocabulary size                           50257
#   MIN_FREQUENCY  minimum count of a merged pair            2
#   SPEAKERS       conversation speakers, comma-separated    user,bot
#   RESERVED       number of <unusedN> tokens                0
#   FROM_MONGO     1: stream texts from MongoDB, not shards  0
#   CONFIG         connection config (with FROM_MONGO=1)     configs/mongo.json
set -euo pipefail
# shellcheck source=pipelines/_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
if script_help "$@"; then
  echo
  exec dsgpt2 vocab train --help  # the flags it passes on; nothing trained
fi

VOCAB_CORPUS="${VOCAB_CORPUS:-runs/vocab_corpus}"
TOKENIZER="${TOKENIZER:-runs/tokenizer}"
VOCAB_SIZE="${VOCAB_SIZE:-50257}"
MIN_FREQUENCY="${MIN_FREQUENCY:-2}"
SPEAKERS="${SPEAKERS:-user,bot}"
RESERVED="${RESERVED:-0}"
FROM_MONGO="${FROM_MONGO:-0}"
CONFIG="${CONFIG:-configs/mongo.json}"

args=(vocab train --out "$TOKENIZER" --vocab_size "$VOCAB_SIZE" --min_frequency "$MIN_FREQUENCY"
  --speakers "$SPEAKERS" --reserved "$RESERVED")
if [[ "$FROM_MONGO" == "1" ]]; then
  args+=(--from_mongo --config "$CONFIG")
else
  args+=(--input "$VOCAB_CORPUS")
fi
exec dsgpt2 "${args[@]}" "$@"
