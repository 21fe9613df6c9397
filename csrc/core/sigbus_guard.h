// Turns the SIGBUS of a touched page past the end of a truncated, mapped
// checkpoint into a zero page, so the process survives until the reader's
// next identity check reports the truncation as an error (File::check_unchanged).
//
// Registered ranges are the Mappings' own; a SIGBUS anywhere else goes to the
// handler that was installed before (Python's faulthandler, or the default
// action). The handler only reads a fixed table of atomics and calls mmap,
// so it is async-signal-safe in practice (mmap is a plain system call).
#pragma once

#include <cstddef>
#include <cstdint>

namespace pyloader {

// Adds [addr, addr + len) to the guarded ranges (installing the handler on
// first use). Returns a slot for unguard(), or -1 when the table is full
// (the range is then unguarded, as without this facility).
int guard_range(const void* addr, size_t len);
void unguard_range(int slot);

// PYLOADER_NO_SIGBUS_GUARD=1 in the environment disables the guard.

// SIGBUS faults absorbed so far (pages replaced by zeros), for tests and stats.
uint64_t guarded_faults();

}  // namespace pyloader
