# shellcheck shell=bash
# Sourced by scripts/*.sh and examples/*/run.sh so that they run right after `make train` or
# `make test`, without `source .venv/bin/activate`: when the `python` on PATH cannot import
# align_anything and the checkout has the project's .venv (which make creates), PYTHON becomes
# the venv's interpreter and the venv's launchers (deepspeed, torchrun) are found after the rest
# of PATH. After, not before: a venv `ninja` first on PATH would make DeepSpeed rebuild its
# JIT-compiled CPU ops (their build hash depends on the ninja version), about a minute each.
# An environment of your own (activated, or PYTHON=...) is used as it is. TORCH_EXTENSIONS_DIR
# (where DeepSpeed compiles its ops) defaults to a folder inside whichever environment runs.
AA_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -z "${PYTHON:-}" ]; then
    PYTHON=python
    if ! python -c "import align_anything" >/dev/null 2>&1; then
        if [ -x "$AA_ROOT/.venv/bin/python" ]; then
            PYTHON="$AA_ROOT/.venv/bin/python"
            export PATH="$PATH:$AA_ROOT/.venv/bin"
        else
            echo "error: no Python environment with align_anything here: run 'make setup' in" \
                "$AA_ROOT (or activate an environment where it is installed)" >&2
            exit 2
        fi
    fi
fi
export PYTHON
# DeepSpeed's JIT-compiled ops go into the environment's own folder (as the Makefile sets it): a
# folder shared by two environments makes each rebuild the ops the other built last.
if [ -z "${TORCH_EXTENSIONS_DIR:-}" ]; then
    TORCH_EXTENSIONS_DIR="$("$PYTHON" -c 'import sys; print(sys.prefix)')/torch_extensions"
    export TORCH_EXTENSIONS_DIR
fi
