"""Build step: write the type stub of the extension with nanobind's stubgen.

Usage: python stubgen.py MODULE_DIR OUTPUT.pyi MARKER_FILE

nanobind_add_stub() runs stubgen as a plain import of the module, which fails here:
the extension finds libmlx.so through its install rpath ($ORIGIN/../mlx/lib), valid
only once installed next to the mlx package ("libmlx.so: cannot open shared object
file"), and the MLX array type is named in signatures only when mlx.core has
registered it. Importing mlx.core first loads libmlx.so and registers the type; then
stubgen runs as it would from the command line.
"""

import runpy
import sys

import mlx.core  # noqa: F401 - loads libmlx.so, registers mlx.core.array

module_dir, output, marker = sys.argv[1:4]
sys.path.insert(0, module_dir)
sys.argv = ["nanobind.stubgen", "-q", "-m", "_core", "-o", output, "-M", marker]
runpy.run_module("nanobind.stubgen", run_name="__main__", alter_sys=True)
