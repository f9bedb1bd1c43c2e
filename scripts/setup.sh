#!/usr/bin/env bash
# Creates .venv with everything k3sched needs. Idempotent; safe to re-run.
# torch: the CPU build 2.13.0 that lies on this kind of machine is installed first, so the
# project's torch range is satisfied without pulling a multi-GB CUDA build. On a GPU machine whose
# system python already imports a torch that sees CUDA, the venv is created with
# --system-site-packages and that torch is kept (no CPU torch installed over it). Otherwise,
# install a CUDA torch into the venv first (or set K3SCHED_TORCH="torch==X+cuYYY").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    echo "setup: $PY has a CUDA torch ($("$PY" -c 'import torch; print(torch.__version__)')); the venv uses it" \
         "(--system-site-packages)" >&2
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
VPIP=(.venv/bin/python -m pip -q --disable-pip-version-check)
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  quiet "${VPIP[@]}" install "${K3SCHED_TORCH:-torch==2.13.0}"
elif .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  # keep the CUDA torch: pin it so that installing the project cannot replace it with another build
  TORCH_PIN=$(.venv/bin/python -c "import torch; print('torch==' + torch.__version__)")
  export PIP_CONSTRAINT="${PIP_CONSTRAINT:-$(mktemp)}"
  echo "$TORCH_PIN" >> "$PIP_CONSTRAINT"
fi
# deepspeed ships as an sdist whose build imports torch: build it against the venv's torch.
quiet "${VPIP[@]}" install --no-build-isolation -e ".[dev]"
# Nsight Systems (Debian non-free, 2022.4) records NVTX ranges of CPU runs; optional.
if [ "${K3SCHED_NSYS:-1}" = 1 ] && ! command -v nsys >/dev/null 2>&1; then
  bash scripts/install_nsys.sh || echo "setup: nsight-systems not installed; nsys tests will skip" >&2
fi
# iproute2 (ip, tc) for the shaped-link testbed (k3sched run --emulate-links, root only); optional.
if ! command -v tc >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  { apt-get install -y -q iproute2 || { apt-get update -q && apt-get install -y -q iproute2; }; } >/dev/null 2>&1 \
    || echo "setup: iproute2 not installed; testbed tests will skip" >&2
fi
touch .venv/.k3sched-setup
