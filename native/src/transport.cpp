#include "tnt/transport.hpp"

namespace tnt {

bool check_agrees(const int64_t check[kCheckValues]) {
  for (int i = 0; i < kCheckValues / 2; ++i)
    if (check[i] != -check[kCheckValues / 2 + i]) return false;
  return check[5] == 0;  // (no node said that its ranks disagree)
}

std::string ranks_but(const std::vector<int>& world_ranks, int self) {
  std::string s;
  for (size_t i = 0; i < world_ranks.size(); ++i)
    if (static_cast<int>(i) != self) s += (s.empty() ? "" : ", ") + std::to_string(world_ranks[i]);
  return s.empty() ? "none" : s;
}

}  // namespace tnt
