#include "core/sigbus_guard.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <mutex>

#include "core/platform.h"

namespace pyloader {

namespace {

constexpr int kSlots = 1024;

struct Slot {
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};
};

Slot g_slots[kSlots];
std::atomic<uint64_t> g_faults{0};
struct sigaction g_previous;
std::once_flag g_installed;
uintptr_t g_page = 0;  // the kernel's page, set by install()

void chain(int sig, siginfo_t* info, void* ctx) {
  // Not ours: behave as if this handler did not exist.
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction) return g_previous.sa_sigaction(sig, info, ctx);
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    return g_previous.sa_handler(sig);
  }
  // Default action: restore it and return; the faulting instruction runs
  // again and the kernel delivers SIGBUS with the default action (core dump).
  signal(sig, SIG_DFL);
}

void on_sigbus(int sig, siginfo_t* info, void* ctx) {
  // The address alone decides: Linux reports a page past a file's end as
  // BUS_ADRERR, arm64 XNU as BUS_ADRALN, and only our registered mappings'
  // ranges are ever repaired.
  auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  if (addr != 0) {
    for (auto& s : g_slots) {
      uintptr_t b = s.begin.load(std::memory_order_acquire);
      if (b == 0 || addr < b || addr >= s.end.load(std::memory_order_acquire)) continue;
      // A page of a registered file mapping past the file's end: map a zero
      // page over it and let the instruction run again.
      void* page = reinterpret_cast<void*>(addr & ~(g_page - 1));
      if (mmap(page, g_page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED,
               -1, 0) != MAP_FAILED) {
        g_faults.fetch_add(1, std::memory_order_relaxed);
        return;
      }
      break;
    }
  }
  chain(sig, info, ctx);
}

void install() {
  g_page = static_cast<uintptr_t>(platform().kernel_page);
  struct sigaction sa {};
  sa.sa_sigaction = on_sigbus;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGBUS, &sa, &g_previous);
}

}  // namespace

int guard_range(const void* addr, size_t len) {
  // PYLOADER_NO_SIGBUS_GUARD=1 turns the guard off (to show what it prevents).
  if (!platform().sigbus_guard) return -1;
  std::call_once(g_installed, install);
  auto b = reinterpret_cast<uintptr_t>(addr);
  for (int i = 0; i < kSlots; ++i) {
    uintptr_t expected = 0;
    // Claim with a placeholder end first so the handler never sees a
    // half-written slot as covering anything.
    if (g_slots[i].end.load(std::memory_order_relaxed) == 0 &&
        g_slots[i].begin.compare_exchange_strong(expected, UINTPTR_MAX)) {
      g_slots[i].end.store(b + len, std::memory_order_release);
      g_slots[i].begin.store(b, std::memory_order_release);
      return i;
    }
  }
  return -1;
}

void unguard_range(int slot) {
  if (slot < 0 || slot >= kSlots) return;
  g_slots[slot].begin.store(UINTPTR_MAX, std::memory_order_release);  // matches nothing
  g_slots[slot].end.store(0, std::memory_order_release);
  g_slots[slot].begin.store(0, std::memory_order_release);  // free
}

uint64_t guarded_faults() { return g_faults.load(std::memory_order_relaxed); }

}  // namespace pyloader
