#pragma once
// What GPI-2's start-up (gaspi_start.cpp) leaves for the ring (gaspi_transport.cpp): this
// process's GASPI runtime, and the machine of every rank. Built only against GPI-2.
#include <GASPI.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace tnt {

constexpr int kMaxAddrs = 8;

// One rank's machine as the others see it (exchanged once, when GASPI starts).
struct GaspiMachine {
  char host[64];  // for messages
  char net[96];   // boot id + network namespace: equal for ranks that share addresses and ports
  char pids[96];  // boot id + pid namespace: equal for ranks that see each other's pids
  int32_t pid;
  int32_t naddr;
  uint32_t addr[kMaxAddrs], mask[kMaxAddrs];  // IPv4, network byte order, loopback left out
};

// What this process knows of GASPI.
struct GaspiRuntime {
  enum State : int32_t { kFailed = 0, kNotStarted = 1, kStarted = 2 };
  State state = kNotStarted;
  std::string failure;
  int rank = -1, size = 0, port = 0;
  std::vector<GaspiMachine> machines;  // of every rank
  int next_segment = 0, next_queue = 0;
};

extern std::mutex gaspi_runtime_mutex;  // guards gaspi_runtime
extern GaspiRuntime gaspi_runtime;

// GPI-2's message of `rc`, with its number.
std::string gaspi_error(gaspi_return_t rc);
gaspi_timeout_t gaspi_ms(double seconds);
// "1, 3, 4".
std::string rank_list(const std::vector<int>& ranks);

}  // namespace tnt
