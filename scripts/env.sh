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

# One phase of the first set-up: says what it does and how long it took. The installers' own
# output goes to a log shown only when the phase fails. A Ctrl-C or SIGTERM (to this shell alone
# or to its process group) stops the phase's processes, says so in one line, exits 128 + signal;
# the same command later finds what is missing and installs it.
titanlite_phase() {  # titanlite_phase "what" command [args...]
    local what="$1" log t0=$SECONDS pid rc=0
    shift
    log="$(mktemp)"
    printf 'titanlite: %s ...' "$what" >&2
    _titanlite_stop=""
    trap '_titanlite_stop=INT' INT
    trap '_titanlite_stop=TERM' TERM
    # a process group of its own: a signal reaches it once, from here, and stops all of it
    set -m
    "$@" >"$log" 2>&1 &
    pid=$!
    set +m
    while :; do
        wait "$pid" && rc=0 || rc=$?
        [ -z "$_titanlite_stop" ] && break
        # bash says "Terminated" as it reaps the job it stops here: the one line below says it
        exec 3>&2 2>/dev/null
        kill -TERM -- "-$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
        # the rest of its group (pip under a shell function) ends too: 10 s, then SIGKILL
        local n=0
        while kill -0 -- "-$pid" 2>/dev/null && [ "$n" -lt 200 ]; do sleep 0.05; n=$((n + 1)); done
        kill -KILL -- "-$pid" 2>/dev/null || true
        rm -f "$log"
        exec 2>&3 3>&-
        echo " stopped by SIG$_titanlite_stop after $((SECONDS - t0))s; run the same command again to finish the set-up" >&2
        exit $((128 + $(kill -l "$_titanlite_stop")))
    done
    trap - INT TERM
    if [ "$rc" -eq 0 ]; then
        echo " done in $((SECONDS - t0))s" >&2
        rm -f "$log"
        return 0
    fi
    echo " failed after $((SECONDS - t0))s; its output:" >&2
    cat "$log" >&2
    rm -f "$log"
    return 1
}

titanlite_torch() {
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        "$PY" -m pip install "torch==$TORCH_VERSION"  # CUDA build (PyPI default)
    else
        # No GPU: the CPU build only (a local wheel or PyTorch's CPU index), never a CUDA one.
        "$PY" -m pip install "torch==$TORCH_VERSION+cpu" ||
            "$PY" -m pip install --index-url https://download.pytorch.org/whl/cpu "torch==$TORCH_VERSION"
    fi
}

titanlite_install() {
    local began=$SECONDS rest="torchdata, tensorboard, sentencepiece and the rest"
    [ -n "$1" ] && rest="$rest, with the test and lint tools"
    echo "titanlite: setting up $VENV (once; a few minutes)" >&2
    if [ ! -x "$PY" ]; then
        titanlite_phase "creating the virtual environment" python3 -m venv "$VENV" || return 1
    fi
    if ! titanlite_looking "$PY" -c "import torch"; then
        titanlite_phase "installing torch $TORCH_VERSION" titanlite_torch || return 1
    fi
    titanlite_phase "installing titanlite: $rest" "$PY" -m pip install -e "$ROOT$1" || return 1
    echo "titanlite: $VENV is ready ($((SECONDS - began))s)" >&2
}

# A look at what is installed (its own output hidden): a stop meanwhile is one line too, and
# never taken for a missing package.
titanlite_looking() {  # titanlite_looking command [args...]: the command's exit status
    local rc=0
    _titanlite_stop=""
    trap '_titanlite_stop=INT' INT
    trap '_titanlite_stop=TERM' TERM
    "$@" 2>/dev/null || rc=$?
    trap - INT TERM
    if [ -n "$_titanlite_stop" ]; then
        echo "titanlite: stopped by SIG$_titanlite_stop while checking what $PY holds; nothing was changed" >&2
        exit $((128 + $(kill -l "$_titanlite_stop")))
    fi
    return $rc
}

titanlite_check() {  # the dependencies' list lives in titanlite/tools/venv.py
    titanlite_looking "$PY" "$ROOT/titanlite/tools/venv.py" ${1:+dev}
}

_extra=""
[ "${1:-}" = "dev" ] && _extra="[dev]"
if [ -n "${TITANLITE_PYTHON:-}" ]; then
    PY="$TITANLITE_PYTHON"
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    if ! command -v "$PY" >/dev/null 2>&1 || [ -d "$PY" ]; then
        echo "titanlite: error: TITANLITE_PYTHON=$PY is not a program that can be run; point it at a Python interpreter such as $(command -v python3 || echo /usr/bin/python3) or unset TITANLITE_PYTHON to use $VENV" >&2
        exit 2
    fi
    if [ "$("$PY" -c "import sys; print(sys.version_info >= (3, 10))" 2>/dev/null)" != True ]; then
        echo "titanlite: error: TITANLITE_PYTHON=$PY is not a Python 3.10 or newer; point it at one or unset TITANLITE_PYTHON to use $VENV" >&2
        exit 2
    fi
    if ! titanlite_check "$_extra"; then
        echo "titanlite: error: TITANLITE_PYTHON=$PY lacks a dependency (see pyproject.toml); install it there or unset TITANLITE_PYTHON to use $VENV" >&2
        exit 2
    fi
elif [ -e "$VENV" ] && [ ! -d "$VENV" ]; then
    if [ -n "${TITANLITE_VENV:-}" ]; then
        echo "titanlite: error: TITANLITE_VENV=$VENV is a file, not a folder; point it at a folder (made if it does not exist) or unset TITANLITE_VENV to use $ROOT/.venv" >&2
    else
        echo "titanlite: error: $VENV, the virtual environment's folder, is a file; move it away, or set TITANLITE_VENV to a folder" >&2
    fi
    exit 2
elif ! { [ -x "$PY" ] && titanlite_check "$_extra"; }; then
    titanlite_install "$_extra" || { echo "titanlite: error: could not install into $VENV; see pip's output above" >&2; exit 1; }
fi
unset _extra
