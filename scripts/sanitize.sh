#!/usr/bin/env bash
# Builds the extension with sanitizers and runs the tests that exercise the
# C++ core (parser, fuzz corpus, readers, prefetch queue, pread pool, faults).
#
#   scripts/sanitize.sh asan    # AddressSanitizer + UndefinedBehaviorSanitizer
#   scripts/sanitize.sh tsan    # ThreadSanitizer
#   scripts/sanitize.sh all     # both, one after the other
#
# Each kind gets its own venv ($SAN_VENV_ROOT/venv-<kind>, default .venv-san/)
# and build dir (build/san-<kind>), so a normal build is never disturbed (.ci/run
# runs the asan kind beside its tests).
# Only pyloader's own code (core + bindings + nanobind) is instrumented;
# Python and libmlx are not, so the sanitizer runtime is LD_PRELOADed into the
# interpreter. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
if [ "$(uname -s)" = Darwin ]; then
  # The runtime is preloaded with LD_PRELOAD (dyld wants DYLD_INSERT_LIBRARIES and
  # refuses it for a signed interpreter), found as libasan.so, and TSan needs setarch:
  # all Linux-only. The sanitizer runs are Linux CI's.
  echo "sanitize.sh: skipped on Darwin (LD_PRELOAD, libasan.so and setarch are Linux-only)" >&2
  exit 0
fi
kind=${1:-asan}
shift || true
if [ "$kind" = all ]; then
  "$0" asan "$@"
  exec "$0" tsan "$@"
fi

case "$kind" in
  asan) flags="address;undefined"; runtime=$(g++ -print-file-name=libasan.so) ;;
  tsan) flags="thread"; runtime=$(g++ -print-file-name=libtsan.so) ;;
  *) echo "usage: $0 asan|tsan|all [pytest args]" >&2; exit 2 ;;
esac

venv=${SAN_VENV_ROOT:-$ROOT/.venv-san}/venv-$kind
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip
  "$venv/bin/pip" install --quiet scikit-build-core nanobind==3.1.0 cmake ninja \
    "mlx==0.32.4" "mlx-cpu==0.32.4" numpy
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
# SAN_SIMD_LEVELS=OFF: the CPU kernels' baseline level alone (its x86 SIMD levels take
# most of the instrumented build's time, and the readers' tests never run them).
pip install --quiet --no-build-isolation ".[test]" \
  -C cmake.define.PYLOADER_SANITIZE="$flags" \
  -C cmake.define.PYLOADER_SIMD_LEVELS="${SAN_SIMD_LEVELS:-ON}" \
  -C cmake.build-type=RelWithDebInfo \
  -C build-dir="build/san-$kind"

# The pyloader the tests will import must be the instrumented build (not a wheel pip
# found elsewhere): its extension calls the sanitizer's runtime.
core=$(python -I -c "import glob, importlib.util as u
print(*glob.glob(u.find_spec('pyloader').submodule_search_locations[0] + '/_core*.so'))")
if [ -z "$core" ] || ! nm -D $core | grep " U __${kind%an}an_" >/dev/null; then
  echo "sanitize.sh: $core is not built with -fsanitize=$flags" >&2; exit 1
fi

[ "${SAN_BUILD_ONLY:-0}" = 1 ] && exit 0

# The tests that drive the C++ core. Model-level streaming tests are included
# for the prefetcher and the pread pool (llama only: the point is the threads,
# not the architectures).
# SAN_TESTS="tests/a.py tests/b.py" replaces the list.
TESTS=(tests/test_format_rules.py tests/test_fuzz.py tests/test_load.py
       tests/test_native.py tests/test_faults.py tests/test_resources.py
       "tests/test_streaming.py::test_io_error_surfaces_at_the_layer"
       "tests/test_streaming.py::test_batch_generation_unchanged")
if [ -n "${SAN_TESTS:-}" ]; then read -r -a TESTS <<< "$SAN_TESTS"; fi

supp=$ROOT/scripts/sanitizers
# Reports go to files: pytest captures stderr, and a halted process loses it.
logs=$ROOT/build/san-$kind/reports
rm -rf "$logs" && mkdir -p "$logs"
export PYLOADER_SANITIZER=$kind  # tests that cannot run under a sanitizer skip on it
export PYTHONMALLOC=malloc       # let ASan see Python-side allocations as plain mallocs
if [ "$kind" = asan ]; then
  # Leak checking is off: the interpreter and libmlx keep process-lifetime
  # allocations that LSan reports at exit; leaks of our own resources are
  # checked by tests/test_resources.py instead (fds, mappings, threads).
  export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:log_path=$logs/asan:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1"
  export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$logs/ubsan:suppressions=$supp/ubsan.supp"
  preload="$runtime $(g++ -print-file-name=libubsan.so)"
else
  export TSAN_OPTIONS="halt_on_error=1:log_path=$logs/tsan:second_deadlock_stack=1:suppressions=$supp/tsan.supp"
  preload="$runtime"
fi
echo "sanitize.sh: $kind ($flags), LD_PRELOAD=$preload" >&2
start=$(date +%s)
# setarch -R: TSan's shadow layout needs the kernel's default mmap layout
# (high-entropy ASLR makes it abort with "unexpected memory mapping").
status=0
LD_PRELOAD="$preload" setarch "$(uname -m)" -R \
  pytest -p no:cacheprovider -q "${TESTS[@]}" "$@" || status=$?
if compgen -G "$logs/*" >/dev/null; then
  echo "sanitize.sh: $kind reports:" >&2
  cat "$logs"/* >&2
  exit 1
fi
[ "$status" = 0 ] || exit "$status"
echo "sanitize.sh: $kind clean in $(( $(date +%s) - start ))s" >&2
