#!/usr/bin/env bash
# The wheel configuration and the workflows, checked offline (docs/platforms.md), since
# macOS wheels cannot be built or run on this Linux machine:
# - cibuildwheel 4.3.5 (the workflow's pin) lists exactly the wheels pyproject.toml
#   [tool.cibuildwheel] is meant to build: CPython 3.10-3.13 for macOS arm64 and
#   manylinux x86-64 / aarch64;
# - that table validates against the JSON schema cibuildwheel ships;
# - .github/workflows/*.yml validate against the GitHub Actions workflow schema that
#   check-jsonschema ships (schema only: actionlint, which would also check expressions and
#   action inputs, installs from PyPI only by downloading a binary).
# What none of this shows is that the build itself works: the wheels workflow builds them.
# Runs in the active environment (Python >= 3.11, cibuildwheel's own floor) from the
# repository root or anywhere; exits non-zero on the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."

python -m pip install --quiet --disable-pip-version-check cibuildwheel==4.3.5 check-jsonschema

expect() {  # expect "DESCRIPTION" "EXPECTED IDENTIFIERS" COMMAND...
  local what=$1 want=$2; shift 2
  local got
  got=$("$@" | tr '\n' ' ' | sed 's/ *$//')
  if [ "$got" != "$want" ]; then
    echo "FAIL: $what: cibuildwheel lists '$got', expected '$want'" >&2
    exit 1
  fi
  echo "ok -- $what: $got"
}
ids() { local p=$1; echo "cp310-$p cp311-$p cp312-$p cp313-$p"; }

expect "macOS wheels" "$(ids macosx_arm64)" \
  cibuildwheel --print-build-identifiers --platform macos
# archs = ["native"]: this machine's architecture (x86_64 here, aarch64 on an arm64 runner).
expect "Linux wheels for this machine" "$(ids "manylinux_$(uname -m)")" \
  cibuildwheel --print-build-identifiers --platform linux
expect "Linux aarch64 wheels" "$(ids manylinux_aarch64)" \
  env CIBW_ARCHS_LINUX=aarch64 cibuildwheel --print-build-identifiers --platform linux

python - <<'EOF'
import sys
import tomllib

import jsonschema
from cibuildwheel.schema import get_schema

with open("pyproject.toml", "rb") as f:
    table = tomllib.load(f)["tool"]["cibuildwheel"]
errors = sorted(jsonschema.Draft7Validator(get_schema()).iter_errors(table), key=str)
for e in errors:
    where = ".".join(map(str, e.absolute_path)) or "(table)"
    print(f"FAIL: pyproject.toml [tool.cibuildwheel] {where}: {e.message}", file=sys.stderr)
if errors:
    sys.exit(1)
print("ok -- pyproject.toml [tool.cibuildwheel] validates against cibuildwheel's schema")
EOF

check-jsonschema --builtin-schema vendor.github-workflows .github/workflows/*.yml
