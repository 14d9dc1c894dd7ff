#include "tnt/transport.hpp"

namespace tnt {

std::string ranks_but(const std::vector<int>& world_ranks, int self) {
  std::string s;
  for (size_t i = 0; i < world_ranks.size(); ++i)
    if (static_cast<int>(i) != self) s += (s.empty() ? "" : ", ") + std::to_string(world_ranks[i]);
  return s.empty() ? "none" : s;
}

}  // namespace tnt
