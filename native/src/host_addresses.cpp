#include "tnt/host_addresses.hpp"

#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/socket.h>

namespace tnt {

std::vector<HostAddress> host_addresses(size_t max) {
  std::vector<HostAddress> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (ifaddrs* i = list; i != nullptr && out.size() < max; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || !i->ifa_netmask) continue;
    if (!(i->ifa_flags & IFF_UP) || (i->ifa_flags & IFF_LOOPBACK)) continue;
    out.push_back({reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr,
                   reinterpret_cast<const sockaddr_in*>(i->ifa_netmask)->sin_addr.s_addr});
  }
  freeifaddrs(list);
  return out;
}

}  // namespace tnt
