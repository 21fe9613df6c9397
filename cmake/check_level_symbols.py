"""Fails the build when a SIMD level's object file defines a symbol another file
could bind to, other than that level's own entry points.

Each csrc/kernels/matmul_<level>.cpp is compiled with its level's flags (AVX-512,
AVX2, baseline). A weak symbol it defines outside its own namespace -- typically an
out-of-line member of a standard template over a built-in type, such as
std::vector<float>::resize -- has the same name in every level's file, and the
linker keeps one copy for the whole library: code of a lower level, or outside the
kernels, could then run AVX-512 instructions on a CPU without them. The levels'
code keeps every such instantiation internal (LevelAllocator in matmul_impl.h);
this check keeps it so.

Usage: check_level_symbols.py NM ARCHIVE [error|warn]

Exits 1 on a violation, or with ``warn`` prints it and exits 0.
"""

from __future__ import annotations

import re
import subprocess
import sys

#: Defined, externally visible symbol types in nm's output (u: a GNU unique global;
#: i: an indirect function). Lower-case w and v are weak references to symbols
#: defined elsewhere, not definitions.
EXTERNAL = set("TDBRVWuiG")
#: The one such symbol every C++ object with exceptions carries.
ALLOWED = {"DW.ref.__gxx_personality_v0"}
MEMBER = re.compile(r"^(?:.*/)?matmul_(\w+)\.cpp\.o(?:bj)?:$")


def violations(nm_output: str) -> list[str]:
    """`level: symbol` for every external symbol a level's object defines outside
    ``pyloader::kernels::<level>::``."""
    bad, level = [], None
    for line in nm_output.splitlines():
        m = MEMBER.match(line.strip())
        if m:
            level = m.group(1)
            continue
        if line.strip().endswith(":"):  # another member (dispatch.cpp.o)
            level = None
            continue
        parts = line.split(None, 2)
        if level is None or len(parts) < 3 or parts[1] not in EXTERNAL:
            continue
        name = parts[2]
        if name in ALLOWED or name.startswith(f"pyloader::kernels::{level}::"):
            continue
        bad.append(f"{level}: {parts[1]} {name}")
    return bad


def main(argv: list[str]) -> int:
    nm, archive, *rest = argv
    mode = rest[0] if rest else "error"
    out = subprocess.run([nm, "-C", archive], capture_output=True, text=True, check=True).stdout
    if not any(MEMBER.match(line.strip()) for line in out.splitlines()):
        print(f"check_level_symbols: no matmul_<level> objects in {archive}", file=sys.stderr)
        return 1
    bad = violations(out)
    if bad:
        print(("warning: " if mode == "warn" else "")
              + "check_level_symbols: these symbols of the SIMD levels' objects could be "
              "bound from other files, compiled with that level's instructions "
              "(cmake/check_level_symbols.py):\n  " + "\n  ".join(bad), file=sys.stderr)
        return 0 if mode == "warn" else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
