#!/usr/bin/env bash
# download_vocab.sh: export the vocabulary corpus from MongoDB to local text shards.
#
# Usage: [VAR=value ...] bash pipelines/download_vocab.sh [more `dsgpt2 vocab download` flags]
#
# Settings (environment variables, with defaults):
#   CONFIG        connection config                          configs/mongo.json
#   VOCAB_CORPUS  shard directory to write                   runs/vocab_corpus
#   FRACTION      draw this fraction of the documents        (all documents)
#   SEED          seed of the draw                           0
#   WORKERS       worker processes, each with its own client 2
# Keep the password in MONGO_CONNECTION_STRING (environment), not in CONFIG.
# Re-running after an interruption writes only the shards that are missing.
set -euo pipefail
# shellcheck source=pipelines/_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
if script_help "$@"; then
  echo
  exec dsgpt2 vocab download --help  # the flags it passes on; nothing downloaded
fi

CONFIG="${CONFIG:-configs/mongo.json}"
VOCAB_CORPUS="${VOCAB_CORPUS:-runs/vocab_corpus}"
FRACTION="${FRACTION:-}"
SEED="${SEED:-0}"
WORKERS="${WORKERS:-2}"

args=(vocab download --config "$CONFIG" --out "$VOCAB_CORPUS" --seed "$SEED" --workers "$WORKERS")
if [[ -n "$FRACTION" ]]; then
  args+=(--fraction "$FRACTION")
fi
exec dsgpt2 "${args[@]}" "$@"
