// The timeline's records (tnt/timeline.hpp).
#include "tnt/timeline.hpp"

#include <atomic>
#include <chrono>
#include <mutex>

namespace tnt::timeline {
namespace {

std::atomic<bool> on{false};
std::mutex records_mutex;
std::vector<Record> records;
int64_t dropped_records = 0;

}  // namespace

bool recording() { return on.load(std::memory_order_relaxed); }

void set_recording(bool value) { on.store(value, std::memory_order_relaxed); }

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void record(const Record& r) {
  if (!recording()) return;
  std::lock_guard<std::mutex> lock(records_mutex);
  if (records.size() >= kCapacity) {
    ++dropped_records;
    return;
  }
  if (records.capacity() == 0) records.reserve(1024);
  records.push_back(r);
}

std::vector<Record> take(int64_t* dropped) {
  std::lock_guard<std::mutex> lock(records_mutex);
  std::vector<Record> out;
  out.swap(records);
  *dropped = dropped_records;
  dropped_records = 0;
  return out;
}

}  // namespace tnt::timeline
