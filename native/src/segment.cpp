#include "tnt/segment.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <random>
#include <system_error>

namespace tnt {
namespace {

[[noreturn]] void throw_errno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

char* map_fd(int fd, size_t bytes, const std::string& name) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    close(fd);
    errno = err;
    throw_errno("mmap of shared-memory segment " + name);
  }
  close(fd);
  return static_cast<char*>(p);
}

}  // namespace

Segment::~Segment() {
  unlink();
  unmap();
}

void Segment::create(const std::string& name, size_t bytes) {
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw_errno("shm_open(" + name + ")");
  name_ = name;
  owner_ = true;
  linked_ = true;
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int err = errno;
    close(fd);
    unlink();
    errno = err;
    throw_errno("ftruncate of shared-memory segment " + name + " (is /dev/shm large enough?)");
  }
  try {
    data_ = map_fd(fd, bytes, name);
  } catch (...) {
    unlink();
    throw;
  }
  size_ = bytes;
}

void Segment::open(const std::string& name, size_t bytes) {
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) throw_errno("shm_open(" + name + ")");
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < bytes) {
    close(fd);
    throw std::runtime_error("shared-memory segment " + name + " is smaller than expected");
  }
  name_ = name;
  data_ = map_fd(fd, bytes, name);
  size_ = bytes;
}

void Segment::unlink() {
  if (owner_ && linked_) {
    shm_unlink(name_.c_str());
    linked_ = false;
  }
}

void Segment::unmap() {
  if (data_) {
    munmap(data_, size_);
    data_ = nullptr;
  }
}

std::string new_segment_name() {
  static std::atomic<unsigned> counter{0};
  std::random_device rd;
  unsigned long r = (static_cast<unsigned long>(rd()) << 32) ^ rd();
  char buf[96];
  snprintf(buf, sizeof buf, "/tnt-%u-%d-%u-%lx", static_cast<unsigned>(getuid()),
           static_cast<int>(getpid()), counter.fetch_add(1), r);
  return buf;
}

}  // namespace tnt
