#!/usr/bin/env bash
# The paths other platforms take, forced on this Linux machine: each switch
# below makes pyloader behave as it does where that path is the default, and a
# representative subset of the suite must pass under it with the same arrays and tokens.
# The switches and what each forces: docs/platform-switches.md and docs/platforms.md.
# Run from the repository root inside the environment .ci/run made (~4 min here).
set -euo pipefail
cd "$(dirname "$0")/.."
run() { echo "+ $*"; python -m pytest -q -p no:cacheprovider "$@"; }

# 1. How mapped bytes become arrays: the copy CUDA gets (copy) and the branch where
#    allocator::make_buffer cannot wrap the bytes (make_buffer: the CPU allocator returns
#    null, so every view becomes a counted copy). tests/test_zero_copy.py, in the main
#    run, already compares every mode's loads, streams, KV cache and expert banks.
for mode in copy make_buffer; do
  PYLOADER_ZERO_COPY=$mode run tests/test_load.py tests/test_lazy_load.py tests/test_heads.py \
    tests/test_experts.py -k "test_load or lazy or swap or page_cache_source"
done

# 2. Apple Silicon's 16 KiB pages, releases by remapping (XNU's MADV_DONTNEED only
#    deactivates pages), many-call preads (XNU refuses > INT_MAX bytes a call) and the
#    portable I/O path (no O_DIRECT, no fadvise, no populate, no io_uring). The
#    deselected tests assert O_DIRECT reads or page-cache eviction, which that path lacks.
(
  export PYLOADER_PAGE_SIZE=16384 PYLOADER_PORTABLE_IO=1 PYLOADER_DROP=remap PYLOADER_PREAD_CAP=1000000
  run tests/test_load.py tests/test_native.py tests/test_stream_buffers.py tests/test_kv.py \
    tests/test_faults.py \
    -k "not (prefetch_populates or leave_no_page_cache or reuses_its_buffers or release_runs_on_the_reader or drop_is_ordered) and (not test_faults or changed_while or restored_mtime or sigbus or deleted)"
  run tests/test_streaming.py tests/test_experts.py -k "llama-bf16 or page_cache_source"
  # Expert banks (four architectures, f32 and 4-bit, resident and streamed layers) and
  # head swaps (cold, then warm: reads nothing).
  run "tests/test_experts.py::test_bit_exact[qwen3_moe-q4-25%-res1-lfu]" \
    "tests/test_experts.py::test_bit_exact[mixtral-f32-50%-res0-lfu]" \
    "tests/test_experts.py::test_bit_exact[gpt_oss-q4-50%-res0-lfu]" \
    "tests/test_experts.py::test_bit_exact[deepseek_v3-f32-1-res0-lru]" \
    "tests/test_heads.py::test_swaps_match_each_variant_bit_for_bit[llama-bf16]" \
    "tests/test_heads.py::test_warm_swap_reads_nothing[llama-bf16]"
)

# 3. A machine without /proc, PSI or cgroups (macOS, a locked-down container): memory and
#    I/O figures come from getrusage/sysconf or are None, never a KeyError; the pre-flight
#    still refuses up front.
#    (tests/test_platform.py, in the main run, turns the switch on and off itself.)
PYLOADER_NO_PROC=1 run tests/test_preflight.py tests/test_load.py tests/test_kv.py \
  tests/test_heads.py tests/test_streaming.py -k "not test_streaming or llama-bf16"
PYLOADER_NO_PROC=1 run "tests/test_experts.py::test_bit_exact[qwen3_moe-f32-1-res0-lru]" \
  "tests/test_experts.py::test_bit_exact[mixtral-q4-50%-res0-lfu]" \
  "tests/test_experts.py::test_page_cache_source_is_bit_exact[qwen3_moe-None-1]"

# 4. Other allocators' buffers over the CPU allocator: CUDA's path (copies, no direct
#    read into MLX's buffers: the deselected tests assert direct reads), and Metal's
#    largest buffer (KV arenas and streaming buffers split into several; the deselected
#    test's arena has a slot over 4 MiB, which is refused with the sizes).
PYLOADER_BUFFER_OWNER=cuda run tests/test_load.py tests/test_kv.py tests/test_stream_buffers.py \
  -k "not (leave_no_page_cache or reuses_its_buffers)"
PYLOADER_MAX_BUFFER_LENGTH=4194304 run tests/test_kv.py -k "not committed_up_front"
PYLOADER_MAX_BUFFER_LENGTH=33554432 run tests/test_stream_buffers.py

# 5. The CPU kernels at each SIMD level below the best this CPU has (the kernel tests run
#    every level in-process; here the models and the streamed runs): the baseline level
#    is what an aarch64 build (NEON) and an x86-64 CPU without AVX2 run, avx512 what one
#    without AMX runs. The level the main run chose itself (the best) is not run again.
best=$(python -c "from pyloader import _core; print(_core.kernel_isa())")
for level in baseline avx2 avx512; do
  if [ "$level" != "$best" ] &&
     python -c "import sys; from pyloader import _core; sys.exit('$level' not in _core.kernel_isas())"; then
    PYLOADER_KERNEL_ISA=$level run tests/test_kernels_models.py
  fi
done
