#include "tnt/wait.hpp"

#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>

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
// From here on a wait is for a peer still computing, not for data on its way.
constexpr std::chrono::milliseconds kLongWait{200};
}  // namespace

void set_spin_microseconds(int us) { spin_us.store(us, std::memory_order_relaxed); }

std::vector<unsigned char> cpu_mask() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) CPU_SET(0, &set);
  const auto* bytes = reinterpret_cast<const unsigned char*>(&set);
  return std::vector<unsigned char>(bytes, bytes + sizeof set);
}

int count_cpus(const std::vector<unsigned char>& masks) {
  std::vector<unsigned char> all(sizeof(cpu_set_t), 0);
  for (size_t i = 0; i < masks.size(); ++i) all[i % all.size()] |= masks[i];
  int n = 0;
  for (unsigned char b : all) n += __builtin_popcount(b);
  return n;
}

bool process_alive(int pid) {
  if (pid <= 0) return true;
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  // A killed child that its launcher has not reaped yet is a zombie: dead for us.
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE* f = fopen(path, "r");
  if (!f) return true;
  char buf[512];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  const char* paren = strrchr(buf, ')');
  if (paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X')) return false;
  return true;
}

bool Backoff::pause() {
  using namespace std::chrono;
  ++spins_;
  auto now = clock::now();
  auto waited = now - start_;
  const int spin = spin_us.load(std::memory_order_relaxed);
  // (Sleeping between tests once the spin ran out slowed MPI_Iallreduce on one host, 2 ranks: with
  // the default 2 ms spin 16 MB took 4.03 ms where MPI_Allreduce took 3.70; with a 50 us spin
  // 1 MB took 311 us against 189 and 16 MB 3.03 ms against 2.65. Polling: 186 us, 2.69 ms.)
  const auto spin_for = polls_progress_ && spin > 0 ? kLongWait : microseconds(spin);
  if (waited < spin_for) {
    // The peer is probably about to arrive: spin (how long: see Engine). Every ~1 us the core
    // is offered to whoever else waits for it: on a machine busier than its ranks (other
    // programs, or ranks of several hosts on one machine) the awaited peer may be the one
    // waiting, and would otherwise get the core only when the scheduler's slice (~4 ms) ends.
    // Measured on 2 cores: 2 test hosts x 2 ranks, 4 KB across hosts, 40-45 us where offering
    // it every ~10 us took 40-95 us (by where the scheduler put the ranks; MPI_Allreduce 75-80
    // us); 1 host x 2 ranks, 4 KB, 2.5-2.6 us against 2.4-2.5 us (offering it at every turn of
    // the loop: 2.9-3.0 us).
    for (int i = 0; i < 4; ++i) TNT_CPU_RELAX();
    if (spins_ % 8 == 0) sched_yield();
  } else if (waited < kLongWait) {
    // Linux rounds a sleep up by the thread's timer slack (50 us by default), which a waiter
    // would add to every collective a peer is late for; 1 us slack keeps the wake-up prompt.
    thread_local const bool slack_set = prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0) == 0;
    (void)slack_set;
    // Give this core away: a training rank's peers and their framework threads (TensorFlow's
    // pools, tf.data) need it more than a waiter does. sched_yield would keep this thread
    // runnable and take CFS's fair share from them; a short sleep does not.
    std::this_thread::sleep_for(microseconds(20));
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
