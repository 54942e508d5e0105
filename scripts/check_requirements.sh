#!/usr/bin/env bash
# Does requirements.txt install from PyPI alone, as on a laptop or a Hugging Face Space? Resolves it (pip's
# --dry-run: metadata only, nothing installed) in a scratch venv of the Python that the README's front matter
# names (`python_version`, what the Space runs), with this machine's pip configuration turned off: no
# PIP_FIND_LINKS, no pip.conf, so no local wheel folder or extra index can hide a pin that PyPI cannot meet.
# Exits non-zero when the pins do not resolve. Usage: bash scripts/check_requirements.sh [PYTHON_VERSION ...]
set -euo pipefail
cd "$(dirname "$0")/.."
front_matter_python=$(awk 'NR == 1 && $0 != "---" {exit} NR > 1 && $0 == "---" {exit} /^python_version:/ {gsub(/["'"'"' ]/, "", $2); print $2}' README.md)
if [ -z "$front_matter_python" ]; then
  echo "check_requirements: README.md's front matter names no python_version (Spaces would use 3.10)" >&2
  exit 1
fi
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=("$front_matter_python")
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
pypi_only() { env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT -u PIP_NO_INDEX \
  PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 "$@"; }
find_python() {  # pythonX.Y on PATH, else pyenv's build of it (its shims answer only for the active version)
  local v=$1 c
  if c=$(command -v "python$v") && "$c" -c 'pass' 2>/dev/null; then echo "$c"; return; fi
  for c in "${PYENV_ROOT:-$HOME/.pyenv}/versions/$v"*/bin/"python$v"; do
    if [ -x "$c" ]; then echo "$c"; return; fi
  done
  return 1
}
for v in "${versions[@]}"; do
  py=$(find_python "$v") || { echo "check_requirements: python$v is not installed" >&2; exit 1; }
  "$py" -m venv "$scratch/py$v"
  pypi_only "$scratch/py$v/bin/python" -m pip install -q --upgrade pip  # a pip that reads PEP 658 metadata
  echo "check_requirements: resolving requirements.txt on Python $v from PyPI alone"
  if ! pypi_only "$scratch/py$v/bin/python" -m pip install --dry-run --ignore-installed -q -r requirements.txt \
      > "$scratch/log" 2>&1; then
    cat "$scratch/log" >&2
    echo "check_requirements: requirements.txt does NOT resolve from PyPI on Python $v" >&2
    exit 1
  fi
done
echo "check_requirements: requirements.txt resolves from PyPI alone on Python ${versions[*]}"
