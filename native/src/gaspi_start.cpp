// GPI-2's start-up: every rank of the world becomes a GASPI process (its machine file, a port
// range free on every host, gaspi_proc_init), once per process.
#include "tnt/gaspi_start.hpp"

#include <stdexcept>

#include "tnt/errors.hpp"

#ifdef TNT_WITH_GASPI

#include <GASPI.h>
#include <GASPI_Ext.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <string>

#include "gaspi_runtime.hpp"
#include "tnt/host_addresses.hpp"

// GPI-2's configuration. gaspi_config_set ignores the TCP device's port (GPI-2 1.6.0), which is
// then only settable here; weak, so that a GPI-2 without the symbol still links (and keeps its
// fixed data port).
extern "C" gaspi_config_t glb_gaspi_cfg __attribute__((weak));

namespace tnt {

std::mutex gaspi_runtime_mutex;
GaspiRuntime gaspi_runtime;

std::string gaspi_error(gaspi_return_t rc) {
  const char* s = gaspi_error_str(rc);
  return std::string(s ? s : "unknown error") + " (" + std::to_string(static_cast<int>(rc)) + ")";
}

gaspi_timeout_t gaspi_ms(double seconds) { return static_cast<gaspi_timeout_t>(seconds * 1000.0); }

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

namespace {

// GPI-2's ports on a host, for local index L (the rank's position among the ranks of its host):
// service network base+L, TCP device base+128+L, topology (during start-up) base+256+L. Bases
// 20480 + 384 k for k < 32 keep whole ranges apart and below Linux's ephemeral ports (32768).
constexpr int kMaxLocal = 128;
constexpr int kTcpOffset = 128;
constexpr int kTopologyOffset = 256;  // fixed by GPI-2 (GASPI_MAX_PPN)
constexpr int kFirstBase = 20480, kBases = 32, kBaseTries = 8;

std::string first_line(const char* path) {
  char buf[128] = {};
  if (FILE* f = fopen(path, "r")) {
    if (!fgets(buf, sizeof buf, f)) buf[0] = 0;
    fclose(f);
  }
  buf[strcspn(buf, "\n")] = 0;
  return buf;
}

std::string namespace_of(const char* kind) {
  char buf[64] = {};
  const std::string path = std::string("/proc/self/ns/") + kind;
  const ssize_t n = readlink(path.c_str(), buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

GaspiMachine this_machine() {
  GaspiMachine m{};
  gethostname(m.host, sizeof m.host - 1);
  std::string boot = first_line("/proc/sys/kernel/random/boot_id");
  if (boot.empty()) boot = m.host;
  snprintf(m.net, sizeof m.net, "%s %s", boot.c_str(), namespace_of("net").c_str());
  snprintf(m.pids, sizeof m.pids, "%s %s", boot.c_str(), namespace_of("pid").c_str());
  m.pid = static_cast<int32_t>(getpid());
  for (const HostAddress& a : host_addresses(kMaxAddrs)) {
    m.addr[m.naddr] = a.ip;
    m.mask[m.naddr] = a.mask;
    ++m.naddr;
  }
  return m;
}

// GPI-2's machine file, one line per rank: 127.0.0.1 while all ranks share one network namespace;
// otherwise each namespace's first address that lies in a subnet of an address of every other
// namespace (the network the hosts share), else its first address.
std::vector<std::string> machine_lines(const std::vector<GaspiMachine>& ms) {
  const size_t p = ms.size();
  std::vector<std::string> lines(p);
  auto same_net = [&](size_t a, size_t b) { return strcmp(ms[a].net, ms[b].net) == 0; };
  std::vector<size_t> firsts;  // the first rank of each namespace
  for (size_t i = 0; i < p; ++i) {
    bool seen = false;
    for (size_t f : firsts) seen = seen || same_net(f, i);
    if (!seen) firsts.push_back(i);
  }
  if (firsts.size() == 1) return std::vector<std::string>(p, "127.0.0.1");
  for (size_t f : firsts) {
    const GaspiMachine& m = ms[f];
    if (m.naddr == 0)
      throw CollectiveError("GASPI: host " + std::string(m.host) + " (rank " + std::to_string(f) +
                            ") has no network address but loopback: the other hosts cannot reach it");
    int chosen = 0;
    for (int a = 0; a < m.naddr; ++a) {
      bool reaches_all = true;
      for (size_t o : firsts) {
        if (o == f) continue;
        bool shared = false;
        for (int b = 0; b < ms[o].naddr; ++b)
          shared = shared || (m.addr[a] & m.mask[a]) == (ms[o].addr[b] & m.mask[a]);
        reaches_all = reaches_all && shared;
      }
      if (reaches_all) {
        chosen = a;
        break;
      }
    }
    char text[INET_ADDRSTRLEN] = {};
    in_addr in{};
    in.s_addr = m.addr[chosen];
    inet_ntop(AF_INET, &in, text, sizeof text);
    for (size_t i = 0; i < p; ++i)
      if (same_net(f, i)) lines[i] = text;
  }
  return lines;
}

// Claims GPI-2's ports for local index `local` from `base` for this process, for as long as it
// lives (an abstract socket, per network namespace, gone with the process): GPI-2 binds them only
// seconds later, and another world starting meanwhile must not choose them too. Returns the first
// port that another process claimed or holds, or 0; releases the claim of an earlier call.
int busy_port(int base, int local) {
  static int claim = -1;
  if (claim >= 0) close(claim);
  claim = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un name{};
  name.sun_family = AF_UNIX;
  const int len = snprintf(name.sun_path + 1, sizeof name.sun_path - 1, "tnt-gaspi-port-%d",
                           base + local);
  if (claim >= 0 && bind(claim, reinterpret_cast<sockaddr*>(&name),
                         static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + len)) != 0) {
    close(claim);
    claim = -1;
    return base + local;
  }
  for (int port : {base + local, base + kTcpOffset + local, base + kTopologyOffset + local}) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);  // as GPI-2 binds them
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    const bool free = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    close(fd);
    if (!free) return port;
  }
  return 0;
}

// Writes the machine file (owner-only, in $TMPDIR); returns its path, or throws.
std::string write_machine_file(const std::vector<std::string>& lines) {
  const char* dir = getenv("TMPDIR");
  std::string path = std::string(dir && *dir ? dir : "/tmp") + "/tnt-gaspi-machines.XXXXXX";
  const int fd = mkstemp(path.data());
  if (fd < 0) throw std::runtime_error(path + ": " + strerror(errno));
  std::string text;
  for (const auto& l : lines) text += l + "\n";
  const bool ok = write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  close(fd);
  if (!ok) {
    unlink(path.c_str());
    throw std::runtime_error(path + ": short write");
  }
  return path;
}

// Buffers of gaspi_start's nonblocking MPI operations: leaked when a wait is given up.
struct StartBuffers {
  int32_t state = 0, base = 0, busy = 0, rc = 0;
  std::vector<int32_t> states, busys, rcs;
  GaspiMachine mine{};
  std::vector<GaspiMachine> machines;
};

void start_steps(MPI_Comm world, int port, double timeout_s, const MpiWait& wait, StartBuffers& b) {
  GaspiRuntime& rt = gaspi_runtime;
  int rank = 0, size = 1;
  MPI_Comm_rank(world, &rank);
  MPI_Comm_size(world, &size);
  MPI_Request req;

  // 1. Has GASPI started, nowhere, everywhere, or failed somewhere?
  b.state = rt.state;
  b.states.resize(static_cast<size_t>(size));
  MPI_Iallgather(&b.state, 1, MPI_INT32_T, b.states.data(), 1, MPI_INT32_T, world, &req);
  wait(&req, "MPI_Iallgather (GASPI state)");
  std::vector<int> failed, started;
  for (int r = 0; r < size; ++r) {
    if (b.states[r] == GaspiRuntime::kFailed) failed.push_back(r);
    if (b.states[r] == GaspiRuntime::kStarted) started.push_back(r);
  }
  if (!failed.empty())
    throw CollectiveError("GASPI failed to start earlier on rank(s) " + rank_list(failed) +
                          (rt.failure.empty() ? "" : " (" + rt.failure + ")") +
                          "; GPI-2 cannot start twice in one process: restart the cluster");
  if (static_cast<int>(started.size()) == size) {
    if (rt.size != size || rt.rank != rank)
      throw CollectiveError("GASPI was started on another world (rank " + std::to_string(rt.rank) +
                            " of " + std::to_string(rt.size) + ")");
    return;
  }
  if (!started.empty())
    throw CollectiveError("GASPI runs on rank(s) " + rank_list(started) +
                          " only; restart the cluster");

  // 2. Every rank's machine: the machine file, local indices, pids for liveness checks.
  b.mine = this_machine();
  b.machines.resize(static_cast<size_t>(size));
  MPI_Iallgather(&b.mine, sizeof(GaspiMachine), MPI_BYTE, b.machines.data(), sizeof(GaspiMachine),
                 MPI_BYTE, world, &req);
  wait(&req, "MPI_Iallgather (GASPI machines)");
  const std::vector<std::string> lines = machine_lines(b.machines);
  std::vector<int> local(static_cast<size_t>(size), 0);
  for (int r = 0; r < size; ++r) {
    for (int q = 0; q < r; ++q) local[r] += lines[q] == lines[r];
    if (local[r] >= kMaxLocal)
      throw CollectiveError("GASPI: more than " + std::to_string(kMaxLocal) + " ranks on host " +
                            std::string(b.machines[r].host));
  }

  // 3. The machine file (rank 0) and a port range that is free on every host.
  std::string mfile, mfile_error;
  if (rank == 0) {
    try {
      mfile = write_machine_file(lines);
    } catch (const std::exception& e) {
      mfile_error = e.what();
    }
  }
  struct RemoveFile {  // rank 0's machine file goes once GPI-2 read it, however the start ends
    std::string path;
    void now() {
      if (!path.empty()) unlink(path.c_str());
      path.clear();
    }
    ~RemoveFile() { now(); }
  } remove{mfile};
  std::vector<int> order(kBases);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(std::random_device()() ^ getpid()));
  b.busys.resize(static_cast<size_t>(size));
  for (int attempt = 0;; ++attempt) {
    b.base = port ? port : kFirstBase + kGaspiPortSpan * order[attempt];
    MPI_Ibcast(&b.base, 1, MPI_INT32_T, 0, world, &req);
    wait(&req, "MPI_Ibcast (GASPI ports)");
    b.busy = !mfile_error.empty() ? -1 : busy_port(b.base, local[rank]);
    MPI_Iallgather(&b.busy, 1, MPI_INT32_T, b.busys.data(), 1, MPI_INT32_T, world, &req);
    wait(&req, "MPI_Iallgather (GASPI ports)");
    if (b.busys[0] < 0)
      throw CollectiveError("GASPI: rank 0 could not write GPI-2's machine file" +
                            (mfile_error.empty() ? std::string() : ": " + mfile_error));
    int holder = -1;
    for (int r = 0; r < size && holder < 0; ++r)
      if (b.busys[r] > 0) holder = r;
    if (holder < 0) break;
    const std::string where = "port " + std::to_string(b.busys[holder]) + " is in use on host " +
                              b.machines[holder].host + " (" + lines[holder] + ", rank " +
                              std::to_string(holder) + ")";
    if (port)
      throw CollectiveError("GASPI: " + where + "; GPI-2 needs ports " + std::to_string(port) +
                            "-" + std::to_string(port + kGaspiPortSpan - 1) +
                            " free on every host: choose another TNT_GASPI_PORT");
    if (attempt + 1 == kBaseTries)
      throw CollectiveError("GASPI: no port range was free on every host after " +
                            std::to_string(kBaseTries) + " tries (last: " + where +
                            "); set TNT_GASPI_PORT to the first of " +
                            std::to_string(kGaspiPortSpan) + " free ports");
  }

  // 4. GPI-2's bootstrap from its environment, then its start (once per process).
  setenv("GASPI_RANK", std::to_string(rank).c_str(), 1);
  setenv("GASPI_NRANKS", std::to_string(size).c_str(), 1);
  setenv("GASPI_SOCKET", std::to_string(local[rank]).c_str(), 1);
  setenv("GASPI_MFILE", rank == 0 ? mfile.c_str() : "(read by rank 0 only)", 1);
  unsetenv("GASPI_SET_NUMA_SOCKET");  // placement is the launcher's business
  gaspi_config_t cfg;
  gaspi_config_get(&cfg);
  cfg.sn_port = static_cast<gaspi_uint>(b.base);
  cfg.build_infrastructure = GASPI_TOPOLOGY_NONE;  // peers connect when a transport is built
  gaspi_return_t rc = gaspi_config_set(cfg);
  if (rc == GASPI_SUCCESS && &glb_gaspi_cfg != nullptr && cfg.network == GASPI_ETHERNET)
    glb_gaspi_cfg.dev_config.params.tcp.port = static_cast<gaspi_uint>(b.base + kTcpOffset);
  rt.state = GaspiRuntime::kFailed;  // from here on, whatever happens: no second try here
  if (rc == GASPI_SUCCESS) rc = gaspi_proc_init(gaspi_ms(timeout_s));
  remove.now();
  b.rc = static_cast<int32_t>(rc);
  b.rcs.resize(static_cast<size_t>(size));
  MPI_Iallgather(&b.rc, 1, MPI_INT32_T, b.rcs.data(), 1, MPI_INT32_T, world, &req);
  wait(&req, "MPI_Iallgather (GASPI start)");
  std::string errors;
  for (int r = 0; r < size; ++r) {
    if (b.rcs[r] == GASPI_SUCCESS) continue;
    errors += (errors.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + ": " +
              gaspi_error(static_cast<gaspi_return_t>(b.rcs[r]));
  }
  if (!errors.empty()) {
    rt.failure = "gaspi_proc_init with ports from " + std::to_string(b.base) + ": " + errors;
    throw CollectiveError("GASPI could not start (" + rt.failure +
                          "); GPI-2 cannot start twice in one process: restart the cluster");
  }
  rt.state = GaspiRuntime::kStarted;
  rt.rank = rank;
  rt.size = size;
  rt.port = b.base;
  rt.machines = b.machines;
}

}  // namespace

bool gaspi_available() { return true; }

void gaspi_start(MPI_Comm world, int port, double timeout_s, const MpiWait& wait) {
  std::lock_guard<std::mutex> lock(gaspi_runtime_mutex);
  auto b = std::make_unique<StartBuffers>();
  try {
    start_steps(world, port, timeout_s, wait, *b);
  } catch (...) {
    (void)b.release();  // a given-up MPI operation may still write into it
    throw;
  }
}

}  // namespace tnt

#else  // built without GPI-2

namespace tnt {

bool gaspi_available() { return false; }

void gaspi_start(MPI_Comm, int, double, const MpiWait&) {
  throw std::logic_error("this build has no GASPI transport");
}

}  // namespace tnt

#endif
