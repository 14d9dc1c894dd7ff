#include "tnt/abort_notices.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <utility>

#include "tnt/host_addresses.hpp"

namespace tnt {
namespace {

// In front of a notice's text.
struct Wire {
  uint64_t token;
  int32_t target;  // the world rank it is meant for (a host's addresses may reach other ranks)
  int32_t sender;
};

// Where the other ranks send to: the host's addresses, or the loopback where it has nothing else
// (its ranks are then one machine's pseudo-nodes).
std::vector<uint32_t> notice_addresses() {
  std::vector<uint32_t> out;
  for (const HostAddress& a : host_addresses(kNoticeAddresses)) out.push_back(a.ip);
  if (out.empty()) out.push_back(htonl(INADDR_LOOPBACK));
  return out;
}

}  // namespace

uint64_t random_token() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

AbortNotices::AbortNotices() {
  fd_ = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd_ < 0) return;
  sockaddr_in any{};
  any.sin_family = AF_INET;
  any.sin_addr.s_addr = htonl(INADDR_ANY);
  sockaddr_in bound{};
  socklen_t len = sizeof bound;
  if (bind(fd_, reinterpret_cast<const sockaddr*>(&any), sizeof any) != 0 ||
      getsockname(fd_, reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
    close(fd_);
    fd_ = -1;
    return;
  }
  port_ = bound.sin_port;
  ipv4_ = notice_addresses();
}

AbortNotices::~AbortNotices() {
  if (fd_ >= 0) close(fd_);
}

NoticeAddress AbortNotices::address(uint64_t token) const {
  NoticeAddress a;
  a.token = token;
  if (fd_ < 0) return a;
  a.port = port_;
  a.count = static_cast<uint16_t>(ipv4_.size());
  std::copy(ipv4_.begin(), ipv4_.end(), a.ipv4.begin());
  return a;
}

void AbortNotices::set_world(const std::vector<NoticeAddress>& all, int self,
                             std::vector<bool> remote) {
  world_ = all;
  token_ = all.empty() ? 0 : all[0].token;
  self_ = self;
  remote_ = std::move(remote);
}

void AbortNotices::announce(const std::string& why) {
  if (fd_ < 0) return;
  std::vector<char> msg(sizeof(Wire) + std::min(why.size(), kAbortNoticeBytes));
  std::memcpy(msg.data() + sizeof(Wire), why.data(), msg.size() - sizeof(Wire));
  for (size_t r = 0; r < world_.size(); ++r) {
    if (!remote_[r]) continue;
    const Wire w{token_, static_cast<int32_t>(r), self_};
    std::memcpy(msg.data(), &w, sizeof w);
    const NoticeAddress& to = world_[r];
    for (int i = 0; i < std::min<int>(to.count, kNoticeAddresses); ++i) {
      sockaddr_in dst{};
      dst.sin_family = AF_INET;
      dst.sin_port = to.port;
      dst.sin_addr.s_addr = to.ipv4[static_cast<size_t>(i)];
      // (a full socket buffer or an unreachable host drops the notice: nothing waits for it)
      (void)sendto(fd_, msg.data(), msg.size(), MSG_DONTWAIT | MSG_NOSIGNAL,
                   reinterpret_cast<const sockaddr*>(&dst), sizeof dst);
    }
  }
}

std::string AbortNotices::poll() {
  if (!seen_.empty() || fd_ < 0) return seen_;
  char buf[sizeof(Wire) + kAbortNoticeBytes];
  for (;;) {  // (what is not for this world or this rank is dropped)
    const ssize_t n = recv(fd_, buf, sizeof buf, MSG_DONTWAIT);
    if (n < 0) return {};
    Wire w;
    if (static_cast<size_t>(n) < sizeof w) continue;
    std::memcpy(&w, buf, sizeof w);
    if (w.token != token_ || w.target != self_) continue;
    seen_.assign(buf + sizeof w, static_cast<size_t>(n) - sizeof w);
    if (seen_.empty()) seen_ = "rank " + std::to_string(w.sender) + " gave up a collective";
    return seen_;
  }
}

}  // namespace tnt
