#include "tnt/path_choice.hpp"

#include <algorithm>
#include <cmath>

namespace tnt {
namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

Path PathChoice::next(const SiteKey& key, bool* timed) {
  *timed = false;
  if (policy_ != PathPolicy::automatic)
    return policy_ == PathPolicy::mpi ? Path::mpi : Path::engine;
  if (sites_.size() >= kMaxSites && !sites_.count(key)) sites_.clear();
  SiteStats& s = sites_[key];
  const int64_t c = s.calls++;
  const int64_t w = c - s.probe_at;
  if (w < 0 || w >= 2 * s.samples) return s.chosen;
  *timed = true;
  return w % 2 == 0 ? Path::mpi : Path::engine;
}

bool PathChoice::record(const SiteKey& key, Path path, double seconds, double medians[2]) {
  auto it = sites_.find(key);
  if (it == sites_.end()) return false;
  SiteStats& s = it->second;
  s.times[static_cast<int>(path)].push_back(seconds);
  const int needed = s.samples + s.pooled;
  if (static_cast<int>(s.times[0].size()) < needed || static_cast<int>(s.times[1].size()) < needed)
    return false;
  medians[0] = median(s.times[0]);
  medians[1] = median(s.times[1]);
  return true;
}

void PathChoice::decide(const SiteKey& key, const double agreed[2]) {
  auto it = sites_.find(key);
  if (it == sites_.end()) return;
  SiteStats& s = it->second;
  const Path chosen = agreed[1] < agreed[0] ? Path::mpi : Path::engine;
  // A first decision follows the warm-up, where a slow start of either path can mislead it, and
  // a change of path may come from one noisy window of 3 samples: either is checked soon, by its
  // window's samples and the next window's together (a check is never checked again).
  const bool check = s.pooled == 0 && (s.decisions == 0 || chosen != s.chosen);
  s.chosen = chosen;
  s.seconds[0] = agreed[0];
  s.seconds[1] = agreed[1];
  ++s.decisions;
  s.pooled = check ? s.samples : 0;
  s.samples = kReprobeSamples;
  if (check) {
    s.probe_at = s.calls + kCheckAfter;
    return;
  }
  const double fast = std::min(agreed[0], agreed[1]), slow = std::max(agreed[0], agreed[1]);
  const double loss = fast > 0 ? slow / fast - 1 : 1.0;
  const double interval = kReprobeSamples * loss / kProbeCost;
  s.probe_at = s.calls + std::clamp(static_cast<int64_t>(std::ceil(interval)), kMinInterval,
                                    kMaxInterval);
  s.times[0].clear();
  s.times[1].clear();
}

}  // namespace tnt
