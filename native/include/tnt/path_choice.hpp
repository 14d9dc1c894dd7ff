#pragma once
// Which way each allreduce call site goes: the engine's own path (shared memory inside a node, the
// transport between nodes) or MPI_Allreduce of the same world. Chosen from measured times while a
// program runs: a training loop calls the same sites (size, dtype, op, bucket) over and over, so
// each site is probed on both paths now and then and otherwise takes the faster one.
//
// Every rank must take the same path at the same call, so the schedule depends only on how often
// a site was called (the same on every rank), and a decision uses times agreed on by all ranks
// (the caller reduces them across the world: see Engine). Schedule of one site:
//   calls 0 and 1: engine (warm-up: first mappings, page faults), not timed
//   a probe window of 2k calls alternating mpi, engine, ...; the last one ends with a decision:
//     the faster path by the slowest rank's median, for the next `interval` calls
//   then probe again (k = kReprobeSamples), so that a change of the host's phase is followed;
//   the first decision, and any that changes the path, is checked by a window kCheckAfter calls
//   later, decided on both windows' samples (start-up noise can mislead a first window, and one
//   noisy window of 3 samples a later one).
// The interval keeps the probes' cost near kProbeCost of the site's time: the slower path runs
// k times per window, so interval ~ k * (slow / fast - 1) / kProbeCost, within bounds.
#include <cstddef>
#include <cstdint>
#include <map>
#include <tuple>
#include <vector>

namespace tnt {

enum class Path : int32_t { engine = 0, mpi = 1 };
// What the user allows: both (chosen by measurement) or only one of them.
enum class PathPolicy : int32_t { automatic = 0, engine = 1, mpi = 2 };

constexpr int kWarmupCalls = 2;
constexpr int kFirstSamples = 5;    // per path in the first probe window
constexpr int kReprobeSamples = 3;  // per path in later windows
constexpr double kProbeCost = 0.01;
constexpr int64_t kCheckAfter = 20;  // calls from a first or changed decision to its check
constexpr int64_t kMinInterval = 200, kMaxInterval = 20000;
constexpr size_t kMaxSites = 4096;  // more distinct sites: forget them all and start again

// (count, dtype, op, bucket) of a call: what every rank passes alike (whether its arrays are
// shared ones is its own affair, and a key that differed across ranks would split their paths).
using SiteKey = std::tuple<int64_t, int32_t, int32_t, int64_t>;

struct SiteStats {
  int64_t calls = 0;          // calls made at this site so far
  int64_t probe_at = kWarmupCalls;  // first call of the next probe window
  int samples = kFirstSamples;      // per path in that window
  int pooled = 0;                   // per path kept from the last window for the next decision
  Path chosen = Path::engine;
  int decisions = 0;
  double seconds[2] = {0, 0};       // the last decision's agreed medians (engine, mpi)
  std::vector<double> times[2];     // this window's measurements
};

class PathChoice {
 public:
  explicit PathChoice(PathPolicy policy) : policy_(policy) {}

  // The path of the next call at `key`, and whether that call is timed for a probe.
  Path next(const SiteKey& key, bool* timed);
  // Records the time of a timed call; true when the window is complete and a decision is due:
  // the caller then agrees on `medians` (engine, mpi) across ranks and calls decide().
  bool record(const SiteKey& key, Path path, double seconds, double medians[2]);
  void decide(const SiteKey& key, const double agreed[2]);
  // Forgets every site (after ranks disagreed on a call: their counts may differ now).
  void reset() { sites_.clear(); }
  const std::map<SiteKey, SiteStats>& sites() const { return sites_; }
  PathPolicy policy() const { return policy_; }

 private:
  PathPolicy policy_;
  std::map<SiteKey, SiteStats> sites_;
};

}  // namespace tnt
