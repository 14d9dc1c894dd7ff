#pragma once
// Bounded waiting: spin briefly, then yield, then sleep; every few milliseconds run the checks
// (deadline, liveness of the awaited peers, abort flag, interrupt).
#include <chrono>
#include <functional>
#include <vector>

namespace tnt {

// Returns true when a Python exception (KeyboardInterrupt, ...) is pending and the wait must stop.
using InterruptCheck = std::function<bool()>;

// How long waits spin before yielding the core. The engine sets 0 when the node's ranks outnumber
// its cores (the awaited rank then needs our core to make progress).
void set_spin_microseconds(int us);
// The set of cores this process may run on, as bytes (to be combined across local ranks), and
// the number of cores in the union of such sets.
std::vector<unsigned char> cpu_mask();
int count_cpus(const std::vector<unsigned char>& masks_concatenated);
// False once process `pid` (of this machine) has exited, also while it is an unreaped zombie.
bool process_alive(int pid);

class Backoff {
 public:
  // With `polls_progress` the readiness test is what moves the awaited data (an MPI collective):
  // where the spin policy lets waits spin at all, they spin as long as a blocking MPI call would
  // (up to the long-wait threshold) instead of sleeping between tests.
  explicit Backoff(bool polls_progress = false) : polls_progress_(polls_progress) {}
  // One step of waiting; call in a loop after a failed readiness test.
  // Returns true when it is time to run the (more expensive) checks.
  bool pause();

 private:
  using clock = std::chrono::steady_clock;
  bool polls_progress_;
  unsigned spins_ = 0;
  clock::time_point start_ = clock::now();
  clock::time_point last_check_ = start_;
};

}  // namespace tnt
