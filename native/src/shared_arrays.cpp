#include "tnt/shared_arrays.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <map>
#include <mutex>
#include <string>
#include <system_error>

namespace tnt {
namespace {

struct Block {
  size_t bytes;
  int fd;
  bool free;
  bool retired;
};

std::mutex blocks_mutex;
std::map<uintptr_t, Block> blocks;  // by address

// The block holding address `a` (blocks.end() if none); the caller holds blocks_mutex.
std::map<uintptr_t, Block>::iterator block_holding(uintptr_t a) {
  auto it = blocks.upper_bound(a);
  if (it == blocks.begin()) return blocks.end();
  --it;
  return a < it->first + it->second.bytes ? it : blocks.end();
}

[[noreturn]] void throw_errno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

}  // namespace

char* shared_alloc(size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t need = std::max(page, (bytes + page - 1) / page * page);
  std::lock_guard<std::mutex> lock(blocks_mutex);
  // The smallest free block that fits without wasting more than the request itself.
  auto best = blocks.end();
  for (auto it = blocks.begin(); it != blocks.end(); ++it)
    if (it->second.free && it->second.bytes >= need && it->second.bytes <= 2 * need &&
        (best == blocks.end() || it->second.bytes < best->second.bytes))
      best = it;
  if (best != blocks.end()) {
    best->second.free = false;
    return reinterpret_cast<char*>(best->first);
  }
  const int fd = memfd_create("tnt-array", MFD_CLOEXEC);
  if (fd < 0) throw_errno("memfd_create");
  // Owner-only like the segments (a memfd starts 0777; peers open it through /proc/<pid>/fd).
  if (fchmod(fd, 0600) != 0) {
    const int err = errno;
    close(fd);
    errno = err;
    throw_errno("fchmod of a shared array");
  }
  if (ftruncate(fd, static_cast<off_t>(need)) != 0) {
    const int err = errno;
    close(fd);
    errno = err;
    throw_errno("ftruncate of a shared array of " + std::to_string(need) + " bytes");
  }
  void* p = mmap(nullptr, need, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    close(fd);
    errno = err;
    throw_errno("mmap of a shared array of " + std::to_string(need) + " bytes");
  }
  blocks.emplace(reinterpret_cast<uintptr_t>(p), Block{need, fd, false, false});
  return static_cast<char*>(p);
}

void shared_free(char* data) {
  std::lock_guard<std::mutex> lock(blocks_mutex);
  auto it = blocks.find(reinterpret_cast<uintptr_t>(data));
  if (it != blocks.end()) it->second.free = !it->second.retired;
}

void shared_retire(const void* p) {
  std::lock_guard<std::mutex> lock(blocks_mutex);
  auto it = block_holding(reinterpret_cast<uintptr_t>(p));
  if (it != blocks.end()) it->second.retired = true;
}

std::optional<SharedLoc> shared_find(const void* p, size_t bytes) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lock(blocks_mutex);
  auto it = block_holding(a);
  if (it == blocks.end() || a + bytes > it->first + it->second.bytes) return std::nullopt;
  return SharedLoc{it->second.fd, static_cast<int64_t>(it->second.bytes),
                   static_cast<int64_t>(a - it->first)};
}

char* map_peer_block(int pid, int64_t fd, size_t bytes) {
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  const int own = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (own < 0) throw_errno("open " + path);
  struct stat st;
  if (fstat(own, &st) != 0 || static_cast<size_t>(st.st_size) < bytes) {
    close(own);
    errno = EINVAL;
    throw_errno(path + " is not the shared array announced");
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, own, 0);
  const int err = errno;
  close(own);
  errno = err;
  if (p == MAP_FAILED) throw_errno("mmap of " + path);
  return static_cast<char*>(p);
}

void unmap_peer_block(char* data, size_t bytes) { munmap(data, bytes); }

}  // namespace tnt
