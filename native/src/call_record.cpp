#include "tnt/call_record.hpp"

#include <algorithm>

namespace tnt {

uint64_t CallRecord::enter(const char* kind, const Call& call, size_t count, size_t bytes,
                           uint64_t seq) {
  std::lock_guard<std::mutex> lock(m_);
  const bool bootstrap = kind[0] == 's';  // "start-up": not one of the numbered collectives
  if (seq == 0 && !bootstrap) seq = ++entered_;
  active_.push_back(ActiveCall{seq, kind, call, count, bytes, std::chrono::steady_clock::now()});
  return seq;
}

void CallRecord::leave(uint64_t seq, bool failed) {
  std::lock_guard<std::mutex> lock(m_);
  auto it = std::find_if(active_.begin(), active_.end(),
                         [seq](const ActiveCall& a) { return a.seq == seq; });
  if (it == active_.end()) return;
  if (failed && seq > 0) failed_ = *it;
  active_.erase(it);
}

bool CallRecord::last_failed(ActiveCall* out) const {
  std::lock_guard<std::mutex> lock(m_);
  if (failed_.seq == 0) return false;
  *out = failed_;
  return true;
}

bool CallRecord::oldest(ActiveCall* out) const {
  std::lock_guard<std::mutex> lock(m_);
  if (active_.empty()) return false;
  *out = *std::min_element(active_.begin(), active_.end(),
                           [](const ActiveCall& a, const ActiveCall& b) { return a.seq < b.seq; });
  return true;
}

uint64_t CallRecord::entered() const {
  std::lock_guard<std::mutex> lock(m_);
  return entered_;
}

}  // namespace tnt
