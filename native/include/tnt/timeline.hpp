#pragma once
// The timeline's records: when this process's collectives (and the train step's marks) began and
// ended, on the steady clock that Python's time.monotonic_ns() reads too. Process-wide, so that
// it outlives a rebuilt engine; off, a call costs one relaxed atomic load. Python turns it on for
// a sampled step and takes what it holds after it (tnt_notebook/rank/timeline.py).
#include <cstddef>
#include <cstdint>
#include <vector>

namespace tnt::timeline {

// What a record is: a whole allreduce, a start or a finish of one in halves, a step's mark.
enum Kind : int64_t { kWhole = 0, kStart = 1, kFinish = 2, kMark = 3 };
// How an allreduce travelled: the engine's own algorithms, MPI_Allreduce, or messages posted at
// its start (a mark's `path` is its label).
enum Path : int64_t { kEngine = 0, kMpiAllreduce = 1, kPosted = 2 };

struct Record {
  int64_t kind, path, bucket, bytes, begin_ns, end_ns;
};

// At most this many records between two take()s; later ones are counted as dropped.
constexpr size_t kCapacity = size_t{1} << 14;

bool recording();
void set_recording(bool on);
int64_t now_ns();
// Keeps `r` while recording.
void record(const Record& r);
// The records kept since the last take(), oldest first, and how many were dropped; empties both.
std::vector<Record> take(int64_t* dropped);

}  // namespace tnt::timeline
