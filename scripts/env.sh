# Sourced by run_train.sh and scripts/test.sh: makes sure the virtualenv exists and holds what
# titanlite needs, then sets PY to its python. Idempotent and quick once installed.
#   TITANLITE_VENV   where the venv lives (default: <repo>/.venv)
#   TITANLITE_PYTHON an interpreter that already holds the dependencies (a cluster's container,
#                    a GPU image): used as it is, nothing installed, titanlite from this tree
#   $1 = dev         also install the test/lint tools
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TITANLITE_VENV:-$ROOT/.venv}"
TORCH_VERSION="2.13.0"
PY="$VENV/bin/python"

titanlite_install() {
    echo "titanlite: setting up $VENV (once)" >&2
    [ -x "$PY" ] || python3 -m venv "$VENV" || return 1
    if ! "$PY" -c "import torch" 2>/dev/null; then
        if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
            "$PY" -m pip install -q "torch==$TORCH_VERSION" || return 1  # CUDA build (PyPI default)
        else
            # No GPU: the CPU build only (a local wheel or PyTorch's CPU index), never a CUDA one.
            "$PY" -m pip install -q "torch==$TORCH_VERSION+cpu" 2>/dev/null ||
                "$PY" -m pip install -q --index-url https://download.pytorch.org/whl/cpu \
                    "torch==$TORCH_VERSION" || return 1
        fi
    fi
    "$PY" -m pip install -q -e "$ROOT$1" || return 1
}

titanlite_check() {  # the dependencies' list lives in titanlite/tools/venv.py
    "$PY" "$ROOT/titanlite/tools/venv.py" ${1:+dev} 2>/dev/null
}

_extra=""
[ "${1:-}" = "dev" ] && _extra="[dev]"
if [ -n "${TITANLITE_PYTHON:-}" ]; then
    PY="$TITANLITE_PYTHON"
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    if ! titanlite_check "$_extra"; then
        echo "titanlite: error: TITANLITE_PYTHON=$PY lacks a dependency (see pyproject.toml); install it there or unset TITANLITE_PYTHON to use $VENV" >&2
        exit 2
    fi
elif ! { [ -x "$PY" ] && titanlite_check "$_extra"; }; then
    titanlite_install "$_extra" || { echo "titanlite: error: could not install into $VENV; see pip's output above" >&2; exit 1; }
fi
unset _extra
