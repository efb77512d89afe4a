#!/usr/bin/env bash
# Creates .venv at the repo root with the pinned stack (constraints.txt).
# Idempotent: when setup.py and constraints.txt are unchanged since the last
# successful run, it installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "setup_env: torch_on_tpu is pinned for Python 3.11; '$python' is $("$python" --version 2>&1). Set PYTHON=python3.11." >&2
  exit 1
fi

[ -x .venv/bin/python ] || "$python" -m venv .venv

stamp=.venv/.torch_on_tpu-stack
want=$(cat setup.py constraints.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "setup_env: .venv is up to date"
  exit 0
fi

pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" --upgrade pip
# torch first and by exact version, so no dependency can pull a CUDA build.
"${pip[@]}" -c constraints.txt torch==2.13.0
"${pip[@]}" -c constraints.txt -e ".[cpu,all,test]"
echo "$want" > "$stamp"
echo "setup_env: .venv ready ($(.venv/bin/python -c 'import torch, jax; print("torch", torch.__version__, "jax", jax.__version__)'))"
