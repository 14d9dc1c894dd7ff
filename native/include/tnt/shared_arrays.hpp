#pragma once
// Arrays that the other ranks of the node can reach: memfd blocks, which a peer maps through
// /proc/<pid>/fd/<fd>. An allreduce on such an input or output lets the other ranks read or write
// it in place instead of staging it through the segment (tnt.empty in Python). A freed block is
// kept for reuse, never unmapped: a peer may still have it mapped, and a collective given up
// half-way may still write into it.
#include <cstddef>
#include <cstdint>
#include <optional>

namespace tnt {

// Where a buffer lies: its block (fd, size) and its offset in the block.
struct SharedLoc {
  int64_t fd = -1;
  int64_t block_bytes = 0;
  int64_t offset = 0;
};

// A block of at least `bytes`, page-aligned (a free one if one fits); throws std::system_error.
char* shared_alloc(size_t bytes);
// Gives a block from shared_alloc back for reuse (unless it was retired).
void shared_free(char* data);
// Never hands out again the block holding `p`: after a failed collective another rank may still
// be writing into it.
void shared_retire(const void* p);
// The block holding all of [p, p + bytes), if there is one.
std::optional<SharedLoc> shared_find(const void* p, size_t bytes);
// Maps block `fd` (of `bytes`) of process `pid`; throws std::system_error.
char* map_peer_block(int pid, int64_t fd, size_t bytes);
void unmap_peer_block(char* data, size_t bytes);

}  // namespace tnt
