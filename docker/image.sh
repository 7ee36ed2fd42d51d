#!/usr/bin/env bash
# image.sh: build the toolkit's image (make image) with docker or podman, whichever runs here. On a
# machine that reaches no image registry, the base is a Debian bookworm made with debootstrap and every
# package comes from a wheelhouse of the lock made on this machine (pip reaches the index here, not
# from inside a build). docker/test-image.sh runs the pipeline inside it.
#
# Usage: bash docker/image.sh
#
# Settings (environment variables, with defaults):
#   ENGINE        docker or podman                 docker where its daemon answers, else podman
#   IMAGE         the image built                  dsgpt2:latest
#   BASE_IMAGE    the base image                   python:3.11-slim where it can be pulled, else
#                                                  localhost/debian:bookworm (made here by debootstrap)
#   WHEELS        index or wheelhouse              index where the base could be pulled, else wheelhouse
#   PYTHON        makes the wheelhouse (3.11)      .venv/bin/python (make venv)
#   DEBIAN_MIRROR debootstrap's mirror             http://deb.debian.org/debian
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck source=docker/_engine.sh
source docker/_engine.sh
containers_can_run || echo "image.sh: the image builds, but no container will start here: $NO_FIREWALL" >&2
DEBIAN_BASE="localhost/debian:bookworm"
PULLED_BASE="docker.io/library/python:3.11-slim"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

# The base: the user's; python:3.11-slim where a registry answers; else a Debian bookworm of our own.
make_debian_base() {
  if has_image "$DEBIAN_BASE"; then
    echo "== base: $DEBIAN_BASE (made before)"
    return
  fi
  command -v debootstrap >/dev/null 2>&1 \
    || die "no registry answered and debootstrap is missing: apt-get install debootstrap, or give BASE_IMAGE"
  [[ "$(id -u)" -eq 0 ]] || die "no registry answered; debootstrap needs root: run as root, or give BASE_IMAGE"
  local dir
  dir="$(mktemp -d -t dsgpt2-rootfs.XXXXXX)"
  cleanups+=("rm -rf '$dir' '$dir.log'")
  echo "== base: debootstrap --variant=minbase bookworm (about a minute), imported as $DEBIAN_BASE"
  debootstrap --variant=minbase bookworm "$dir" "$DEBIAN_MIRROR" > "$dir.log" 2>&1 \
    || { tail -5 "$dir.log" >&2; die "debootstrap failed"; }
  tar -C "$dir" -c . | "$ENGINE" import - "$DEBIAN_BASE" >/dev/null
}

if [[ -z "${BASE_IMAGE:-}" ]]; then
  if can_pull "$PULLED_BASE"; then
    BASE_IMAGE="$PULLED_BASE"
    WHEELS="${WHEELS:-index}"
  else
    echo "== no registry answered for $PULLED_BASE: a base and a wheelhouse of our own"
    make_debian_base
    BASE_IMAGE="$DEBIAN_BASE"
    WHEELS="${WHEELS:-wheelhouse}"
  fi
fi
WHEELS="${WHEELS:-index}"

# The wheelhouse: every package the image installs, at the lock's versions, as wheels built or
# downloaded by this machine's pip (DeepSpeed ships a source archive only). A Python 3.11, as the base's.
make_wheelhouse() {
  local python="${PYTHON:-}" constraints torch_spec torch_index log
  if [[ -z "$python" ]]; then
    # The project's environment: the lock's pip, and DeepSpeed's build requirements at hand.
    [[ -x .venv/bin/python ]] || make venv
    python=".venv/bin/python"
  fi
  [[ "$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" == 3.11 ]] \
    || die "the wheelhouse needs a Python 3.11 (the base's): PYTHON=$python is not; give PYTHON=/path/to/python3.11"
  constraints="$(mktemp -t dsgpt2-constraints.XXXXXX)"
  log="$(mktemp -t dsgpt2-wheelhouse.XXXXXX)"
  cleanups+=("rm -f '$constraints' '$log'")
  grep -v '^torch==' requirements.lock > "$constraints"
  torch_spec="torch==$(sed -n 's/^torch==//p' requirements.lock)"
  torch_index="https://download.pytorch.org/whl/cpu"
  echo "== wheelhouse: the lock's packages for the image, into docker/wheelhouse/"
  # The CPU build of torch from its index (PyPI's would be a CUDA build of several GB).
  if ! "$python" -m pip wheel -q --retries 1 -c "$constraints" --build-constraint "$constraints" \
    --index-url "$torch_index" --extra-index-url https://pypi.org/simple \
    -w docker/wheelhouse "$torch_spec" pip setuptools ".[local]" > "$log" 2>&1; then
    grep -v -e "is ignored: it is neither a file nor a directory" -e "^WARNING: Retrying" "$log" | tail -20 >&2
    die "pip could not make the wheelhouse"
  fi
  rm -f docker/wheelhouse/dsgpt2-*.whl
}

build() {
  if [[ "$WHEELS" == wheelhouse ]]; then
    make_wheelhouse
  fi
  local uid=1000 gid=1000
  if [[ "$(id -u)" -ne 0 && "$ENGINE" == docker ]]; then
    uid="$(id -u)"
    gid="$(id -g)"  # files the container writes to a bind mount belong to the user
  fi
  echo "== build: $IMAGE with $ENGINE, on $BASE_IMAGE, packages from the $WHEELS"
  local start=$SECONDS
  "$ENGINE" build "${build_network[@]}" -f docker/Dockerfile -t "$IMAGE" \
    --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg WHEELS="$WHEELS" \
    --build-arg APP_UID="$uid" --build-arg APP_GID="$gid" .
  echo "== built $IMAGE in $((SECONDS - start)) s"
}

build
