# shellcheck shell=bash
# _env.sh: sourced by the pipeline scripts, not run on its own.
#
# In a fresh shell nothing is activated: when no virtual environment is active and the project's
# .venv (made by `make venv`, `make demo` or `make test`) exists, its bin/ goes first on PATH, so that
# `dsgpt2`, `deepspeed` and `python` are the project's. An active environment, or an install without
# .venv (the Docker image), is left as it is.
project_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${VIRTUAL_ENV:-}" && -x "$project_root/.venv/bin/dsgpt2" ]]; then
  export PATH="$project_root/.venv/bin:$PATH"
fi
if ! command -v dsgpt2 >/dev/null 2>&1; then
  echo "$(basename "$0"): no dsgpt2 command: run \`make venv\` in $project_root (or pip install .)" >&2
  exit 2
fi

# `--help` (or -h) among a script's arguments: its header comment (usage and settings), then true.
# A script that runs one dsgpt2 command passes the flag on instead, after this.
script_help() {
  local arg
  for arg in "$@"; do
    if [[ "$arg" == "-h" || "$arg" == "--help" ]]; then
      sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p;}' "$0"
      return 0
    fi
  done
  return 1
}
