#!/bin/sh
# Makes PREFIX (/opt/python/cpXY-cpXY) the interpreter prefix cibuildwheel expects of a
# manylinux image, from PYTHON (a uv-managed CPython). cibuildwheel 4.3.5
# (platforms/linux.py) puts PREFIX/bin first on PATH and then requires that `which python`
# and `which pip` are PREFIX/bin/python and PREFIX/bin/pip, runs `python -m build`, and
# runs `pip install virtualenv` before testing each wheel. uv's Pythons have no pip and are
# marked EXTERNALLY-MANAGED (PEP 668), which refuses such installs; a virtual environment
# created from the interpreter has pip (ensurepip) and is not externally managed.
# Usage: python-prefix.sh PYTHON PREFIX
set -eu
python=$1 prefix=$2
"$python" -m venv "$prefix"
"$prefix/bin/python" -m pip install --no-cache-dir --disable-pip-version-check --upgrade pip build
# What cibuildwheel checks, checked at image build time.
PATH="$prefix/bin:$PATH"
test "$(which python)" = "$prefix/bin/python"
test "$(which pip)" = "$prefix/bin/pip"
python -m build --version
