#!/usr/bin/env bash
# test-image.sh: the built image run as a user runs it (make test-image builds it first, with
# docker/image.sh). Two checks, each ending in the files it left in a runs/ of this machine:
#
# 1. One container, as the image's non-root user: `dsgpt2 --help`, then pipelines/all.sh on the
#    built-in sample (its defaults: the tiny model, 300 steps) against the embedded local:// database,
#    in a runs/ mounted from here.
# 2. The compose stack: compose.yaml, with docker/compose.embedded.yaml where no mongo:7 image can be
#    pulled (the image's own `dsgpt2 db serve` is then the mongo service): the database healthy first,
#    then the pipeline against it over the stack's network, authenticated with the .env's user.
#
# Each leaves a tokenizer, a complete checkpoint, an export that GPT2LMHeadModel.from_pretrained loads
# and an evaluation (its report, a perplexity below the untrained model's, its line in the log); the
# password appears in no log and no output.
#
# Usage: bash docker/test-image.sh
#
# Settings (environment variables, with defaults):
#   ENGINE      docker or podman              docker where its daemon answers, else podman
#   IMAGE       the image tested              dsgpt2:latest
#   COMPOSE     the compose command           docker compose, else docker-compose; "skip": no stack
#   TEST_RUNS   where the outputs go          a new temporary directory (removed when green)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck source=docker/_engine.sh
source docker/_engine.sh

ITERS=300  # pipelines/all.sh's TRAIN_ITERS, which compose.yaml leaves as it is
containers_can_run || die "$NO_FIREWALL"
has_image "$IMAGE" || die "no image $IMAGE: build it first (make image)"
work="${TEST_RUNS:-$(mktemp -d -t dsgpt2-test-image.XXXXXX)}"
mkdir -p "$work"
start=$SECONDS

check() {
  if ! eval "$1"; then
    echo "test-image.sh: FAIL: $2" >&2
    exit 1
  fi
  echo "ok: $2"
}

# A runs/ the image's user (uid 1000) writes to, as compose.yaml's runs-init makes it.
make_runs() {
  mkdir -p "$1"
  if [[ "$(id -u)" -eq 0 ]]; then
    chown 1000:1000 "$1"
  fi
}

run_in_image() {
  local runs="$1" user_ns=()
  shift
  if [[ "$ENGINE" == podman && "$(id -u)" -ne 0 ]]; then
    user_ns=(--userns "keep-id:uid=1000,gid=1000")  # rootless podman: the mount's files stay the user's
  fi
  # Bounded: a run that hangs must not hang CI (its container is removed by name when named).
  timeout 1200 "$ENGINE" run --rm "${user_ns[@]}" --shm-size 1g -v "$runs:/app/runs" "$@"
}

# check_outputs RUNS LOG: what pipelines/all.sh leaves in RUNS/pipeline, and its evaluation line in LOG.
check_outputs() {
  local runs="$1" log="$2" run="$1/pipeline" line
  check "[[ -s '$run/tokenizer/tokenizer.json' ]]" "tokenizer: $run/tokenizer/tokenizer.json"
  check "[[ -s '$run/ckpt/global_step$ITERS/dsgpt2_complete.json' ]]" \
    "checkpoint: $run/ckpt/global_step$ITERS, complete"
  check "[[ -s '$run/eval/report.json' ]]" "evaluation report: $run/eval/report.json"
  line="$(sed -n '/== evaluate/,/== stages/p' "$log" | grep -E -m1 'loss [0-9.]+, perplexity [0-9.]+' || true)"
  if [[ -z "$line" ]]; then
    echo "test-image.sh: FAIL: no evaluation line in $log" >&2
    exit 1
  fi
  echo "ok: the evaluation's line: ${line#*| }"
  # The untrained model is at about the vocabulary's size (8,192); the sample's unigrams at ~950.
  check "python3 -c \"import json, sys; sys.exit(json.load(open('$run/eval/report.json'))['metrics']['perplexity'] >= 2000)\"" \
    "the model learned: perplexity $(python3 -c "import json; print(round(json.load(open('$run/eval/report.json'))['metrics']['perplexity'], 1))") < 2,000"
  run_in_image "$runs" "$IMAGE" python -c "from transformers import GPT2LMHeadModel
m = GPT2LMHeadModel.from_pretrained('runs/pipeline/model')
print(type(m).__name__, m.num_parameters())" > "$runs/loaded.txt" 2>&1 || true
  check "grep -q '^GPT2LMHeadModel ' '$runs/loaded.txt'" \
    "GPT2LMHeadModel.from_pretrained loads $run/model ($(tail -1 "$runs/loaded.txt"))"
}

# 1. One container.
runs="$work/container"
make_runs "$runs"
run_in_image "$runs" "$IMAGE" dsgpt2 --help > "$work/help.txt"
check "grep -q '^usage: dsgpt2' '$work/help.txt'" "dsgpt2 --help in the image"
run_in_image "$runs" "$IMAGE" id -u > "$work/uid.txt"
check "[[ \$(cat '$work/uid.txt') != 0 ]]" "the container runs as a non-root user (uid $(cat "$work/uid.txt"))"
echo "== pipelines/all.sh in a container (local:// in the mounted runs/; 1-2 minutes on two cores)"
pipeline="dsgpt2-test-image-$$"
cleanups+=("$ENGINE rm -f $pipeline > /dev/null 2>&1")
if ! run_in_image "$runs" --name "$pipeline" "$IMAGE" bash pipelines/all.sh > "$work/container.log" 2>&1; then
  tail -30 "$work/container.log" >&2
  die "pipelines/all.sh failed in the container (log: $work/container.log)"
fi
check_outputs "$runs" "$work/container.log"
check "[[ -f '$runs/db/dsgpt2-db.json' ]]" "the embedded database lives in the mounted runs/"

# 2. The compose stack.
compose=()
if [[ "${COMPOSE:-}" == skip ]]; then
  echo "== compose: skipped (COMPOSE=skip)"
elif [[ -n "${COMPOSE:-}" ]]; then
  read -r -a compose <<< "$COMPOSE"
elif docker compose version >/dev/null 2>&1; then
  compose=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then
  compose=(docker-compose)
else
  echo "== compose: no docker compose or docker-compose here, the stack not run" \
    "(Debian: apt-get install docker-compose)"
fi

if [[ ${#compose[@]} -gt 0 ]]; then
  project="$work/compose"
  mkdir -p "$project/docker"
  cp compose.yaml "$project/"
  cp docker/compose.embedded.yaml "$project/docker/"
  make_runs "$project/runs"
  password="pw-$RANDOM$RANDOM-$RANDOM"
  port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  printf 'MONGO_USER=dsgpt2\nMONGO_PASSWORD=%s\nMONGO_PORT=%s\n' "$password" "$port" > "$project/.env"
  name="dsgpt2test$$"
  files=(-f compose.yaml)
  if can_pull docker.io/library/mongo:7 && can_pull docker.io/library/busybox:1.36; then
    echo "== compose: compose.yaml as it is (mongo:7)"
  else
    files+=(-f docker/compose.embedded.yaml)
    echo "== compose: no registry gives mongo:7; its mongo service is the image's dsgpt2 db serve" \
      "(docker/compose.embedded.yaml)"
  fi
  if [[ "$ENGINE" == podman ]]; then
    # Compose speaks docker's API: podman serves it on a socket of this run's own.
    socket="$project/podman.sock"
    podman system service --time=0 "unix://$socket" > "$project/podman-service.log" 2>&1 &
    cleanups+=("kill $!")
    for _ in $(seq 100); do [[ -S "$socket" ]] && break; sleep 0.1; done
    [[ -S "$socket" ]] || die "podman system service did not start (log: $project/podman-service.log)"
    export DOCKER_HOST="unix://$socket"
    # Without systemd podman runs no health check by itself: run each container's, as the engine would.
    (while true; do
      for c in $(podman ps -q --filter "label=com.docker.compose.project=$name" 2>/dev/null); do
        podman healthcheck run "$c" >/dev/null 2>&1 || true
      done
      sleep 5
    done) &
    cleanups+=("kill $!")
  fi
  # Every compose call bounded: one waiting on a health check that never passes must not hang CI.
  stack() {
    (cd "$project" && timeout 900 "${compose[@]}" --env-file "$project/.env" -p "$name" "${files[@]}" "$@")
  }
  cleanups+=("stack down -v --timeout 60 > '$project/down.log' 2>&1")
  echo "== compose up: the database healthy, then the pipeline against it (2-3 minutes on two cores)"
  stack up -d > "$project/up.log" 2>&1 || { tail -20 "$project/up.log" >&2; die "compose up failed"; }
  container="$(stack ps -q dsgpt2)"
  code="$(timeout 1200 "$ENGINE" wait "$container" | tail -1)" || code="timeout"
  stack logs --no-color > "$project/compose.log" 2>&1 || true
  if [[ "$code" != 0 ]]; then
    tail -40 "$project/compose.log" >&2
    die "the pipeline under compose ended with $code (log: $project/compose.log)"
  fi
  check "grep -q 'serving on 0.0.0.0:27017\|Waiting for connections' '$project/compose.log'" \
    "the mongo service served the stack"
  check_outputs "$project/runs" "$project/compose.log"
  check "[[ ! -e '$project/runs/db' ]]" "the data lives in the database's volume, not in runs/"
  # Read from a file: a pattern on grep's command line would show the password to ps.
  printf '%s\n' "$password" > "$project/password"
  check "! grep -rqF -f '$project/password' --exclude=password --exclude=.env '$project'" \
    "the password appears in no log and no output"
fi

cleanup  # the stack down, its volumes removed, before its outputs go
cleanups=()
echo "== test-image green in $((SECONDS - start)) s (outputs: $work)"
if [[ -z "${TEST_RUNS:-}" ]]; then
  rm -rf "$work" 2>/dev/null || true
fi
