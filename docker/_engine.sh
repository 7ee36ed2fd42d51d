# shellcheck shell=bash
# _engine.sh: sourced by docker/image.sh and docker/test-image.sh, not run on its own. Picks the
# container engine and the settings it needs on this machine.
#
#   ENGINE   docker or podman   (docker where its daemon answers, else podman)
#   IMAGE    the toolkit's image                     dsgpt2:latest

IMAGE="${IMAGE:-dsgpt2:latest}"

die() {
  echo "$(basename "$0"): $*" >&2
  exit 2
}

# The engine: docker where its daemon answers (a docker client alone does not build), else podman.
if [[ -z "${ENGINE:-}" ]]; then
  if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    ENGINE=docker
  elif command -v podman >/dev/null 2>&1; then
    ENGINE=podman
  else
    die "no container engine: install docker, or podman (Debian: apt-get install podman runc)"
  fi
fi
command -v "$ENGINE" >/dev/null 2>&1 || die "ENGINE=$ENGINE is not installed"

# Files and processes of this script, removed and stopped when it exits.
cleanups=()
cleanup() {
  local i
  for ((i = ${#cleanups[@]} - 1; i >= 0; i--)); do
    eval "${cleanups[i]}" || true
  done
}
trap cleanup EXIT

# podman's default runtime (crun) refuses to start containers on hosts with hybrid cgroups, and its
# default ulimits can exceed a container host's own: runc, cgroupfs and the host's limits, unless the
# user names a containers.conf of their own.
if [[ "$ENGINE" == podman && -z "${CONTAINERS_CONF:-}" ]] && command -v runc >/dev/null 2>&1; then
  CONTAINERS_CONF="$(mktemp -t dsgpt2-containers.XXXXXX)"
  cleanups+=("rm -f '$CONTAINERS_CONF'")
  printf '[containers]\ndefault_ulimits = []\n[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\n' \
    > "$CONTAINERS_CONF"
  export CONTAINERS_CONF
fi
# podman's network backend netavark sets up each container's network with the host's firewall
# (iptables, or nftables where it is built for it); without either every `podman run` ends in
# "netavark: No such file or directory". Prints what to install, and fails, where it is missing.
# shellcheck disable=SC2034  # read by the scripts that source this file
NO_FIREWALL="podman's network (netavark) needs a firewall to start containers: install iptables (Debian: apt-get install iptables)"
containers_can_run() {
  [[ "$ENGINE" != podman ]] || command -v iptables >/dev/null 2>&1 || command -v nft >/dev/null 2>&1 \
    || [[ -x /usr/sbin/iptables || -x /usr/sbin/nft ]] \
    || [[ "$(podman info --format '{{.Host.NetworkBackend}}' 2>/dev/null)" != netavark ]]
}
# The Dockerfile's wheelhouse mount (RUN --mount) needs BuildKit, which docker before 23 leaves off.
if [[ "$ENGINE" == docker ]]; then
  export DOCKER_BUILDKIT=1
fi
# podman builds on the host's network (its build network may not reach the package mirrors).
# (read by the scripts that source this file)
build_network=()
if [[ "$ENGINE" == podman ]]; then
  # shellcheck disable=SC2034
  build_network=(--network host)
fi

has_image() {
  "$ENGINE" image inspect "$1" >/dev/null 2>&1
}

# can_pull IMAGE: whether IMAGE is here or a registry gives it (within two minutes).
can_pull() {
  has_image "$1" || timeout 120 "$ENGINE" pull -q "$1" >/dev/null 2>&1
}
