#pragma once
// A POSIX shared-memory segment: created owner-only (0600, O_EXCL), mapped with MAP_POPULATE so
// the collectives never page-fault, and unlinked as soon as every local rank has mapped it, so that
// nothing is left in /dev/shm even if a rank crashes later.
#include <cstddef>
#include <string>

namespace tnt {

class Segment {
 public:
  Segment() = default;
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  // Creates and maps a new segment named `name` (must start with '/'); throws std::system_error.
  void create(const std::string& name, size_t bytes);
  // Maps an existing segment created by another local rank.
  void open(const std::string& name, size_t bytes);
  // Removes the name from /dev/shm (the mapping stays valid). Idempotent.
  void unlink();
  void unmap();
  // Drops the mapping without unmapping it (it then lives as long as the process).
  void forget() { data_ = nullptr; }

  char* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  char* data_ = nullptr;
  size_t size_ = 0;
  bool owner_ = false;
  bool linked_ = false;
};

// A fresh, unguessable-enough segment name: /tnt-<uid>-<pid>-<counter>-<random>.
std::string new_segment_name();

}  // namespace tnt
