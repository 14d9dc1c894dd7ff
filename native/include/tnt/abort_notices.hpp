#pragma once
// How a rank that gives up a collective tells the ranks of other nodes why: UDP datagrams, sent
// once and never waited for. Not MPI messages: a rank gives up when a peer may be unreachable,
// and MPICH (UCX netmod) crashes on an MPI_Isend to an endpoint that failed (it writes through the
// null request of the failed send). A datagram to a host that is gone is dropped; a notice that
// does not arrive only leaves its receiver to its own collective timeout.
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace tnt {

// At most this many addresses of a rank's host are tried.
constexpr int kNoticeAddresses = 8;
// A notice's text is cut to this many bytes.
constexpr size_t kAbortNoticeBytes = 1024;

// What a rank publishes at the bootstrap (gathered from every rank as raw bytes): the port of its
// socket and its host's IPv4 addresses (network byte order; none if it has no socket). Rank 0's
// token becomes the world's: notices that do not carry it (another world, anyone else on the
// network) are dropped.
struct NoticeAddress {
  uint64_t token = 0;
  uint16_t port = 0;
  uint16_t count = 0;
  uint32_t pad = 0;
  std::array<uint32_t, kNoticeAddresses> ipv4{};
};

class AbortNotices {
 public:
  // Opens a nonblocking socket on an ephemeral port of every interface. Failing (no socket, no
  // address) is not an error: this rank then hears no notices, and waits out its timeouts.
  AbortNotices();
  ~AbortNotices();
  AbortNotices(const AbortNotices&) = delete;
  AbortNotices& operator=(const AbortNotices&) = delete;

  // This rank's entry for the bootstrap's gather; `token` is used by rank 0 only.
  NoticeAddress address(uint64_t token) const;
  // Every rank's entry, in world rank order; `self` is this rank's world rank, `remote[r]` whether
  // rank r is on another node (only those are told).
  void set_world(const std::vector<NoticeAddress>& all, int self, std::vector<bool> remote);

  // Sends `why` to every rank of the other nodes.
  void announce(const std::string& why);
  // The text of a notice meant for this rank, if one arrived (once one has, always that one).
  std::string poll();

 private:
  int fd_ = -1;
  uint16_t port_ = 0;
  std::vector<uint32_t> ipv4_;
  uint64_t token_ = 0;
  int self_ = 0;
  std::vector<NoticeAddress> world_;
  std::vector<bool> remote_;
  std::string seen_;
};

// 64 random bits for rank 0's token.
uint64_t random_token();

}  // namespace tnt
