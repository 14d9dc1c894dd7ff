#pragma once
// Where other hosts may reach this one: what GPI-2's machine file and the abort notices are told.
#include <cstddef>
#include <cstdint>
#include <vector>

namespace tnt {

struct HostAddress {
  uint32_t ip, mask;  // IPv4, network byte order
};

// The IPv4 addresses of this host's interfaces that are up, the loopback's left out; at most `max`.
std::vector<HostAddress> host_addresses(size_t max);

}  // namespace tnt
