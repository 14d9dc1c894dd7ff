#include "tnt/wait.hpp"

#include <sched.h>

#include <thread>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TNT_CPU_RELAX() _mm_pause()
#else
#define TNT_CPU_RELAX() ((void)0)
#endif

namespace tnt {

bool Backoff::pause() {
  using namespace std::chrono;
  ++spins_;
  auto now = clock::now();
  auto waited = now - start_;
  if (waited < microseconds(50)) {
    // Peers usually arrive within microseconds: spin.
    for (int i = 0; i < 16; ++i) TNT_CPU_RELAX();
  } else if (waited < milliseconds(5)) {
    // Oversubscribed cores: let the awaited rank run.
    sched_yield();
  } else {
    std::this_thread::sleep_for(microseconds(waited < milliseconds(100) ? 50 : 500));
  }
  if (now - last_check_ >= milliseconds(2)) {
    last_check_ = now;
    return true;
  }
  return false;
}

}  // namespace tnt
