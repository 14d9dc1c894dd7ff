#include "tnt/wait.hpp"

#include <sched.h>

#include <atomic>

#include <thread>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TNT_CPU_RELAX() _mm_pause()
#else
#define TNT_CPU_RELAX() ((void)0)
#endif

namespace tnt {
namespace {
std::atomic<int> spin_us{50};
}

void set_spin_microseconds(int us) { spin_us.store(us, std::memory_order_relaxed); }

int available_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  return CPU_COUNT(&set);
}

bool Backoff::pause() {
  using namespace std::chrono;
  ++spins_;
  auto now = clock::now();
  auto waited = now - start_;
  if (waited < microseconds(spin_us.load(std::memory_order_relaxed))) {
    // Peers usually arrive within microseconds: spin.
    for (int i = 0; i < 16; ++i) TNT_CPU_RELAX();
  } else if (waited < milliseconds(200)) {
    // Let the awaited rank (or anyone) run on this core; sched_yield returns at once when
    // nothing else is runnable, so a peer that arrives is seen within microseconds.
    sched_yield();
  } else {
    // A long wait (a peer still computing): stop burning the core.
    std::this_thread::sleep_for(microseconds(500));
  }
  if (now - last_check_ >= milliseconds(2)) {
    last_check_ = now;
    return true;
  }
  return false;
}

}  // namespace tnt
