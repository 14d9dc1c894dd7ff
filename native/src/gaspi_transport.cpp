#include "tnt/gaspi_transport.hpp"

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
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <numeric>
#include <random>
#include <string>

#include "tnt/host_addresses.hpp"
#include "tnt/reduce.hpp"
#include "tnt/wait.hpp"

// GPI-2's configuration. gaspi_config_set ignores the TCP device's port (GPI-2 1.6.0), which is
// then only settable here; weak, so that a GPI-2 without the symbol still links (and keeps its
// fixed data port).
extern "C" gaspi_config_t glb_gaspi_cfg __attribute__((weak));

namespace tnt {
namespace {

// GPI-2's ports on a host, for local index L (the rank's position among the ranks of its host):
// service network base+L, TCP device base+128+L, topology (during start-up) base+256+L. Bases
// 20480 + 384 k for k < 32 keep whole ranges apart and below Linux's ephemeral ports (32768).
constexpr int kMaxLocal = 128;
constexpr int kTcpOffset = 128;
constexpr int kTopologyOffset = 256;  // fixed by GPI-2 (GASPI_MAX_PPN)
constexpr int kFirstBase = 20480, kBases = 32, kBaseTries = 8;
constexpr int kMaxAddrs = 8;
constexpr auto kPeerCheckPeriod = std::chrono::milliseconds(100);

std::string gaspi_error(gaspi_return_t rc) {
  const char* s = gaspi_error_str(rc);
  return std::string(s ? s : "unknown error") + " (" + std::to_string(static_cast<int>(rc)) + ")";
}

gaspi_timeout_t to_ms(double seconds) { return static_cast<gaspi_timeout_t>(seconds * 1000.0); }

// One rank's machine as the others see it (exchanged once, when GASPI starts).
struct Machine {
  char host[64];  // for messages
  char net[96];   // boot id + network namespace: equal for ranks that share addresses and ports
  char pids[96];  // boot id + pid namespace: equal for ranks that see each other's pids
  int32_t pid;
  int32_t naddr;
  uint32_t addr[kMaxAddrs], mask[kMaxAddrs];  // IPv4, network byte order, loopback left out
};

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

Machine this_machine() {
  Machine m{};
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
std::vector<std::string> machine_lines(const std::vector<Machine>& ms) {
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
    const Machine& m = ms[f];
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

// What this process knows of GASPI.
struct Runtime {
  enum State : int32_t { kFailed = 0, kNotStarted = 1, kStarted = 2 };
  State state = kNotStarted;
  std::string failure;
  int rank = -1, size = 0, port = 0;
  std::vector<Machine> machines;  // of every rank
  int next_segment = 0, next_queue = 0;
};

std::mutex runtime_mutex;
Runtime runtime;

// Buffers of gaspi_start's nonblocking MPI operations: leaked when a wait is given up.
struct StartBuffers {
  int32_t state = 0, base = 0, busy = 0, rc = 0;
  std::vector<int32_t> states, busys, rcs;
  Machine mine{};
  std::vector<Machine> machines;
};

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

void start_steps(MPI_Comm world, int port, double timeout_s, const MpiWait& wait, StartBuffers& b) {
  Runtime& rt = runtime;
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
    if (b.states[r] == Runtime::kFailed) failed.push_back(r);
    if (b.states[r] == Runtime::kStarted) started.push_back(r);
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
  MPI_Iallgather(&b.mine, sizeof(Machine), MPI_BYTE, b.machines.data(), sizeof(Machine), MPI_BYTE,
                 world, &req);
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
  rt.state = Runtime::kFailed;  // from here on, whatever happens: no second try in this process
  if (rc == GASPI_SUCCESS) rc = gaspi_proc_init(to_ms(timeout_s));
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
  rt.state = Runtime::kStarted;
  rt.rank = rank;
  rt.size = size;
  rt.port = b.base;
  rt.machines = b.machines;
}

// ---------------------------------------------------------------------------------------------
// The exchange among P ranks (one per node). The engine keeps several exchanges in flight (the
// first round's call check and two pipelined rounds): each takes one of kSlots areas of the
// segment in turn, its own notification ids, and a notification value that names its operation.
// An area holds the data (the part to reduce, copied in) and the receive space.
//
// Two ranks swap their whole parts in one write each and reduce both (a pairwise exchange: one
// latency instead of two). More ranks run a ring, data cut into P blocks: reduce-scatter step
// s < P-1 writes block r-s into the right neighbour's receive space s and reduces the block the
// left one wrote into block r-1-s (rank r then holds block r+1 reduced); allgather step g writes
// block r+1-g to the same place in the right neighbour's data. Only the right neighbour is ever
// written to (the other rank, with two).
//
// A checked call's check travels with its data instead of in an exchange of its own before it:
// two ranks write it in front of their part; in a ring each reduce-scatter step carries, in front
// of its block, the max of the checks of the ranks it has heard from, so that after P-1 steps
// every rank holds the max of all. Ranks whose calls differ still take the same steps with
// blocks of their own sizes, which never exceed the receive space (sized for the largest part):
// every rank completes the exchange, and none uses its data.
//
// An area is written again only once its owner has released it: a rank that completes an
// operation acknowledges it to its writer (a notification named by the operation), and a writer's
// first write of operation m + kSlots waits for the acknowledgement of m. So areas are never
// overwritten however deep the engine pipelines, and nothing depends on it.

constexpr int kSlots = 4;
// A failed transfer, or a write to a process that is gone, may belong to a rank that completed
// the exchange and left: it counts as a loss only if the operation is still incomplete this long
// afterwards.
constexpr auto kLostGrace = std::chrono::seconds(1);

class GaspiTransport;

class Exchange : public Pending {
 public:
  Exchange(GaspiTransport& t, uint64_t op, int64_t* check, char* user, size_t n, DType dtype,
           Op reduce_op);
  ~Exchange() override;
  bool test() override;

 private:
  bool post();      // the current step's write; false while it must wait (queue, release)
  bool finish();    // local completion of our writes, then the result and the release
  bool blocked();   // runs the checks; returns false (test's answer while waiting)
  size_t block_offset(int b) const { return std::min(static_cast<size_t>(b) * c_, n_) * es_; }
  size_t block_bytes(int b) const { return block_offset(b + 1) - block_offset(b); }

  GaspiTransport& t_;
  uint64_t op_;
  int slot_;
  int64_t* check_;  // the caller's call check (null: unchecked), reduced here
  int64_t running_[kCheckValues] = {};  // ring: the max of the checks heard of so far
  bool agrees_ = true;                  // the reduced check agrees (known once it is reduced)
  char* user_;
  size_t n_, es_, c_;
  DType dtype_;
  Op op_kind_;
  gaspi_notification_t value_;
  int step_ = 0;
  bool posted_ = false, done_ = false;
};

class GaspiTransport : public Transport {
 public:
  GaspiTransport(MPI_Comm cross, std::vector<int> world_ranks, size_t max_bytes, double timeout_s,
                 const MpiWait& wait);
  int size() const override { return size_; }
  int rank() const override { return rank_; }
  Pending* start_allreduce(const void* in, void* out, size_t n, DType t, Op op) override {
    return start(nullptr, in, out, n, t, op);
  }
  // The check travels with the data (see Exchange).
  Pending* start_checked_allreduce(int64_t* check, const void* in, void* out, size_t n, DType t,
                                   Op op) override {
    return start(check, in, out, n, t, op);
  }
  // Its segment is never freed or reused anyway: writes of a given-up operation may still land.
  void abandon() override { abandoned_ = true; }
  std::string describe_peers() const override { return ranks_but(world_ranks_, rank_); }

 private:
  friend class Exchange;
  Pending* start(int64_t* check, const void* in, void* out, size_t n, DType t, Op op);
  int mod(int i) const { return ((i % size_) + size_) % size_; }
  int steps() const { return size_ == 2 ? 1 : 2 * (size_ - 1); }
  static gaspi_notification_t value_of(uint64_t op) {
    return static_cast<gaspi_notification_t>(op % 65535 + 1);
  }
  // Notification ids: the steps of each area, then each area's release.
  gaspi_notification_id_t step_id(int slot, int step) const {
    return static_cast<gaspi_notification_id_t>(slot * steps() + step);
  }
  gaspi_notification_id_t release_id(int slot) const {
    return static_cast<gaspi_notification_id_t>(kSlots * steps() + slot);
  }
  size_t data_offset(int slot) const { return static_cast<size_t>(slot) * slot_stride_; }
  size_t probe_offset() const { return kSlots * slot_stride_; }  // where probes read into
  size_t recv_offset(int slot, int step) const {
    return data_offset(slot) + data_bytes_ + static_cast<size_t>(step) * recv_bytes_;
  }
  // Whether the right neighbour released `slot` after operation `op` (it completed it).
  bool released(int slot, uint64_t op);
  // Tells the left neighbour that we completed `op` in `slot`; false while the queue is full.
  bool release(int slot, uint64_t op);
  // Polls the transfers posted so far; notes a failure (see kLostGrace).
  void reap();
  void note_failure(gaspi_return_t rc);
  // The slow path of a wait (every kPeerCheckPeriod at most): peers of this machine alive, the
  // neighbours probed, and a loss noted long enough ago raised as RankLostError.
  void check_peers();
  // Reads a few bytes from each neighbour in turn, one read at a time on a queue of its own. GPI-2's
  // device thread answers a read, whatever the peer's program does: a read to a process that is
  // gone fails (its host closed the connection), and one that stays unanswered for probe_limit_
  // (half the collective timeout) means that the peer's host or its link is down.
  void probe();

  int rank_ = 0, size_ = 1;
  std::vector<int> world_ranks_;
  gaspi_rank_t left_ = 0, right_ = 0;
  gaspi_segment_id_t seg_ = 0, right_seg_ = 0, left_seg_ = 0;
  gaspi_queue_id_t queue_ = 0, probe_queue_ = 0;
  char* base_ = nullptr;
  // An area's data: [head | part] (head_: room for a call check), and its receive space: the
  // other rank's [head | part], or (ring) P-1 of [head | block].
  size_t head_ = 0, data_bytes_ = 0, recv_bytes_ = 0, slot_stride_ = 0;
  uint64_t ops_ = 0;
  bool busy_[kSlots] = {};
  uint64_t released_ops_[kSlots] = {};  // per area: operations released by the right neighbour
  bool abandoned_ = false;
  std::string lost_;  // why transfers failed, if they did
  std::chrono::steady_clock::time_point lost_at_{}, next_check_{};
  gaspi_rank_t probed_ = 0;  // the neighbour of the read in flight, if any
  bool probing_ = false;
  std::chrono::steady_clock::time_point probe_sent_{};
  std::chrono::duration<double> probe_limit_{};
};

// Setup outcome of one rank (exchanged over MPI: all ranks fail together, none waits).
struct SetupBuffers {
  int64_t mine[3] = {0, 0, 0};  // segment id, ok, bytes of an area
  std::vector<int64_t> all;
};

GaspiTransport::GaspiTransport(MPI_Comm cross, std::vector<int> world_ranks, size_t max_bytes,
                               double timeout_s, const MpiWait& wait)
    : world_ranks_(std::move(world_ranks)) {
  std::lock_guard<std::mutex> lock(runtime_mutex);
  if (runtime.state != Runtime::kStarted) throw CollectiveError("GASPI has not started");
  MPI_Comm_rank(cross, &rank_);
  MPI_Comm_size(cross, &size_);
  left_ = static_cast<gaspi_rank_t>(world_ranks_[mod(rank_ - 1)]);
  right_ = static_cast<gaspi_rank_t>(world_ranks_[mod(rank_ + 1)]);
  // Receive space: the whole part from the other rank, or (ring) P-1 blocks of at most
  // ceil(n / P) elements of at most 8 bytes: n * es / P + 8 bytes; each behind a head.
  head_ = (kCheckBytes + 63) / 64 * 64;
  data_bytes_ = head_ + (max_bytes + 63) / 64 * 64;
  recv_bytes_ = size_ == 2 ? data_bytes_ : head_ + (max_bytes / size_ + 8 + 63) / 64 * 64;
  slot_stride_ = data_bytes_ + static_cast<size_t>(steps() == 1 ? 1 : size_ - 1) * recv_bytes_;
  const gaspi_timeout_t ms = to_ms(timeout_s);

  std::string error;
  gaspi_number_t segment_max = 0, queue_num = 1, notification_num = 0;
  gaspi_segment_max(&segment_max);
  gaspi_queue_num(&queue_num);
  gaspi_notification_num(&notification_num);
  // Two queues (data, probes) with nothing left on them from transports given up before (their
  // peers may be gone).
  std::vector<gaspi_queue_id_t> free_queues;
  for (int i = 0; i < static_cast<int>(queue_num) && free_queues.size() < 2; ++i) {
    const auto q = static_cast<gaspi_queue_id_t>((runtime.next_queue + i) % queue_num);
    gaspi_number_t left = 1;
    (void)gaspi_wait(q, GASPI_TEST);
    if (gaspi_queue_size(q, &left) == GASPI_SUCCESS && left == 0) free_queues.push_back(q);
  }
  gaspi_return_t rc = GASPI_ERROR;
  if (release_id(kSlots) + 1 >= notification_num) {  // (GPI-2 reserves the last one)
    error = "a ring of " + std::to_string(size_) + " nodes needs more than the " +
            std::to_string(notification_num) + " GASPI notifications of a segment";
  } else if (free_queues.size() < 2) {
    error = "every GASPI queue still holds transfers of exchanges given up: restart the cluster";
  } else if (runtime.next_segment >= static_cast<int>(segment_max)) {
    error = "all " + std::to_string(segment_max) + " GASPI segments of this process are used " +
            "(one per engine built): restart the cluster";
  } else {
    queue_ = free_queues[0];
    probe_queue_ = free_queues[1];
    runtime.next_queue = probe_queue_ + 1;
    probe_limit_ = std::chrono::duration<double>(timeout_s / 2);
    seg_ = static_cast<gaspi_segment_id_t>(runtime.next_segment++);
    void* ptr = nullptr;
    if ((rc = gaspi_segment_alloc(seg_, probe_offset() + 64, GASPI_MEM_INITIALIZED)) !=
        GASPI_SUCCESS)
      error = "gaspi_segment_alloc: " + gaspi_error(rc);
    else if ((rc = gaspi_segment_ptr(seg_, &ptr)) != GASPI_SUCCESS)
      error = "gaspi_segment_ptr: " + gaspi_error(rc);
    base_ = static_cast<char*>(ptr);
    // The left neighbour writes our data, the right one our releases: both know our segment.
    std::vector<gaspi_rank_t> peers{right_};
    if (left_ != right_) peers.push_back(left_);
    for (gaspi_rank_t peer : peers) {
      if (!error.empty()) break;
      if ((rc = gaspi_connect(peer, ms)) != GASPI_SUCCESS)
        error = "gaspi_connect to rank " + std::to_string(peer) + ": " + gaspi_error(rc);
      else if ((rc = gaspi_segment_register(seg_, peer, ms)) != GASPI_SUCCESS)
        error = "gaspi_segment_register with rank " + std::to_string(peer) + ": " +
                gaspi_error(rc);
    }
  }
  auto b = std::make_unique<SetupBuffers>();
  b->mine[0] = seg_;
  b->mine[1] = error.empty() ? 1 : 0;
  b->mine[2] = static_cast<int64_t>(slot_stride_);
  b->all.resize(3 * static_cast<size_t>(size_));
  MPI_Request req;
  MPI_Iallgather(b->mine, 3, MPI_INT64_T, b->all.data(), 3, MPI_INT64_T, cross, &req);
  try {
    wait(&req, "MPI_Iallgather (GASPI segments)");
  } catch (...) {
    (void)b.release();  // MPI may still write into it
    throw;
  }
  std::vector<int> failed;
  for (int i = 0; i < size_; ++i) {
    if (!b->all[3 * i + 1]) failed.push_back(world_ranks_[i]);
    if (b->all[3 * i + 2] != b->mine[2] && error.empty())
      error = "rank " + std::to_string(world_ranks_[i]) + " has another round size " +
              "(do all ranks use the same TNT_SHM_SEGMENT_BYTES?)";
  }
  if (!failed.empty() || !error.empty())
    throw CollectiveError("GASPI transport setup failed" +
                          (failed.empty() ? std::string() : " on rank(s) " + rank_list(failed)) +
                          (error.empty() ? "" : " (here: " + error + ")"));
  right_seg_ = static_cast<gaspi_segment_id_t>(b->all[3 * mod(rank_ + 1)]);
  probed_ = right_;  // (the first probe reads from the left neighbour)
  left_seg_ = static_cast<gaspi_segment_id_t>(b->all[3 * mod(rank_ - 1)]);
}

Pending* GaspiTransport::start(int64_t* check, const void* in, void* out, size_t n, DType t,
                               Op op) {
  if (abandoned_) throw CollectiveError("the GASPI transport gave up an operation; rebuild it");
  const size_t bytes = n * dtype_size(t);
  if (bytes > data_bytes_ - head_)
    throw CollectiveError("cross-node part of " + std::to_string(bytes) +
                          " bytes exceeds the GASPI segment (" +
                          std::to_string(data_bytes_ - head_) + ")");
  const int slot = static_cast<int>(ops_ % kSlots);
  if (busy_[slot])
    throw CollectiveError("more than " + std::to_string(kSlots) +
                          " GASPI exchanges in flight at once");
  busy_[slot] = true;
  if (check) std::memcpy(base_ + data_offset(slot), check, kCheckBytes);
  if (bytes) copy_bytes(base_ + data_offset(slot) + head_, in, bytes);
  return new Exchange(*this, ops_++, check, static_cast<char*>(out), n, t, op);
}

bool GaspiTransport::released(int slot, uint64_t op) {
  if (released_ops_[slot] > op / kSlots) return true;
  gaspi_notification_id_t got = 0;
  gaspi_return_t rc = gaspi_notify_waitsome(seg_, release_id(slot), 1, &got, GASPI_TEST);
  if (rc == GASPI_TIMEOUT) return false;
  gaspi_notification_t old = 0;
  if (rc == GASPI_SUCCESS) rc = gaspi_notify_reset(seg_, release_id(slot), &old);
  if (rc != GASPI_SUCCESS) throw CollectiveError("gaspi_notify_waitsome/reset: " + gaspi_error(rc));
  if (old != value_of(op))
    throw CollectiveError("GASPI release " + std::to_string(old) + " from rank " +
                          std::to_string(right_) + " belongs to another operation (expected " +
                          std::to_string(value_of(op)) + ")");
  ++released_ops_[slot];
  return true;
}

bool GaspiTransport::release(int slot, uint64_t op) {
  const gaspi_return_t rc =
      gaspi_notify(left_seg_, left_, release_id(slot), value_of(op), queue_, GASPI_TEST);
  if (rc == GASPI_QUEUE_FULL || rc == GASPI_TIMEOUT) {
    reap();
    return false;
  }
  if (rc != GASPI_SUCCESS)
    throw CollectiveError("gaspi_notify to rank " + std::to_string(left_) + ": " + gaspi_error(rc));
  return true;
}

void GaspiTransport::reap() {
  const gaspi_return_t rc = gaspi_wait(queue_, GASPI_TEST);
  if (rc != GASPI_SUCCESS && rc != GASPI_TIMEOUT) note_failure(rc);
}

void GaspiTransport::note_failure(gaspi_return_t rc) {
  if (!lost_.empty()) return;
  // GPI-2 marks the rank whose transfer failed in its state vector.
  std::vector<gaspi_state_t> states(runtime.machines.size(), GASPI_STATE_HEALTHY);
  std::vector<int> failed;
  if (gaspi_state_vec_get(states.data()) == GASPI_SUCCESS)
    for (gaspi_rank_t peer : {left_, right_})
      if (states[peer] != GASPI_STATE_HEALTHY &&
          std::find(failed.begin(), failed.end(), peer) == failed.end())
        failed.push_back(peer);
  if (failed.empty()) failed.push_back(right_);
  lost_ = "the GASPI transfers to rank " + rank_list(failed) + " failed (" + gaspi_error(rc) +
          "): its process or its host is gone";
  lost_at_ = std::chrono::steady_clock::now();
}

void GaspiTransport::probe() {
  if (probing_) {
    const gaspi_return_t rc = gaspi_wait(probe_queue_, GASPI_TEST);
    if (rc == GASPI_TIMEOUT) {
      const auto waited = std::chrono::steady_clock::now() - probe_sent_;
      if (waited < probe_limit_) return;
      char secs[32];
      snprintf(secs, sizeof secs, "%.3g", std::chrono::duration<double>(waited).count());
      throw RankLostError("rank " + std::to_string(probed_) + " (host " +
                          runtime.machines[probed_].host + ") has not answered GASPI for " +
                          secs + " s: its host or its link is down");
    }
    probing_ = false;
    if (rc != GASPI_SUCCESS) return note_failure(rc);
  }
  if (!lost_.empty()) return;
  probed_ = probed_ == left_ ? right_ : left_;
  const gaspi_segment_id_t remote = probed_ == left_ ? left_seg_ : right_seg_;
  if (gaspi_read(seg_, probe_offset(), probed_, remote, 0, 8, probe_queue_, GASPI_TEST) ==
      GASPI_SUCCESS) {
    probing_ = true;
    probe_sent_ = std::chrono::steady_clock::now();
  }
}

void GaspiTransport::check_peers() {
  const auto now = std::chrono::steady_clock::now();
  if (!lost_.empty() && now - lost_at_ > kLostGrace) throw RankLostError(lost_);
  if (now < next_check_) return;
  next_check_ = now + kPeerCheckPeriod;
  const Machine& me = runtime.machines[world_ranks_[rank_]];
  for (int i = 0; i < size_; ++i) {
    const Machine& m = runtime.machines[world_ranks_[i]];
    if (i == rank_ || strcmp(m.pids, me.pids) != 0 || process_alive(m.pid)) continue;
    throw RankLostError("rank " + std::to_string(world_ranks_[i]) + " (pid " +
                        std::to_string(m.pid) + ") died during the inter-node exchange");
  }
  probe();
  reap();
}

Exchange::Exchange(GaspiTransport& t, uint64_t op, int64_t* check, char* user, size_t n,
                   DType dtype, Op reduce_op)
    : t_(t),
      op_(op),
      slot_(static_cast<int>(op % kSlots)),
      check_(check),
      user_(user),
      n_(n),
      es_(dtype_size(dtype)),
      c_((n + static_cast<size_t>(t.size_) - 1) / static_cast<size_t>(t.size_)),
      dtype_(dtype),
      op_kind_(reduce_op),
      value_(GaspiTransport::value_of(op)) {
  if (check_) std::memcpy(running_, check_, kCheckBytes);
}

Exchange::~Exchange() {
  if (!done_) t_.abandoned_ = true;  // its area may still be written: never reused
}

bool Exchange::blocked() {
  t_.check_peers();
  return false;
}

bool Exchange::post() {
  const int P = t_.size_, r = t_.rank_, s = step_;
  if (s == 0 && op_ >= kSlots && !t_.released(slot_, op_ - kSlots)) return false;
  const gaspi_notification_id_t id = t_.step_id(slot_, s);
  gaspi_return_t rc = GASPI_SUCCESS;
  if (P == 2) {  // [head | part] where the call is checked, else the part
    const size_t skip = check_ ? 0 : t_.head_;
    rc = gaspi_write_notify(t_.seg_, t_.data_offset(slot_) + skip, t_.right_, t_.right_seg_,
                            t_.recv_offset(slot_, 0) + skip, t_.head_ - skip + n_ * es_, id,
                            value_, t_.queue_, GASPI_TEST);
  } else {
    const bool scatter = s < P - 1;
    const int block = scatter ? t_.mod(r - s) : t_.mod(r + 1 - (s - (P - 1)));
    const gaspi_offset_t data = t_.data_offset(slot_) + t_.head_ + block_offset(block);
    const gaspi_size_t bytes = block_bytes(block);
    if (!scatter) {  // in place in the neighbour's data
      rc = gaspi_write_notify(t_.seg_, data, t_.right_, t_.right_seg_, data, bytes, id, value_,
                              t_.queue_, GASPI_TEST);
    } else if (!check_) {  // behind the head of the receive space
      rc = gaspi_write_notify(t_.seg_, data, t_.right_, t_.right_seg_,
                              t_.recv_offset(slot_, s) + t_.head_, bytes, id, value_, t_.queue_,
                              GASPI_TEST);
    } else {  // [head | block]: the check so far (ours, then what the last step left), the block
      gaspi_segment_id_t segs[2] = {t_.seg_, t_.seg_}, remote[2] = {t_.right_seg_, t_.right_seg_};
      gaspi_offset_t from[2] = {s ? t_.recv_offset(slot_, s - 1) : t_.data_offset(slot_), data};
      gaspi_offset_t to[2] = {t_.recv_offset(slot_, s), t_.recv_offset(slot_, s) + t_.head_};
      gaspi_size_t sizes[2] = {t_.head_, bytes};
      rc = gaspi_write_list_notify(bytes ? 2 : 1, segs, from, t_.right_, remote, to, sizes,
                                   t_.right_seg_, id, value_, t_.queue_, GASPI_TEST);
    }
  }
  if (rc == GASPI_SUCCESS) return posted_ = true;
  if (rc == GASPI_QUEUE_FULL || rc == GASPI_TIMEOUT) {  // drain the queue, retry on the next test
    t_.reap();
    return false;
  }
  throw CollectiveError("gaspi_write_notify to rank " + std::to_string(t_.right_) + ": " +
                        gaspi_error(rc));
}

bool Exchange::finish() {
  // Our writes must have left the area before the result is taken from it and it is released.
  const gaspi_return_t rc = gaspi_wait(t_.queue_, GASPI_TEST);
  if (rc != GASPI_SUCCESS) {
    if (rc != GASPI_TIMEOUT) t_.note_failure(rc);
    return blocked();
  }
  if (!t_.release(slot_, op_)) return blocked();
  char* data = t_.base_ + t_.data_offset(slot_);
  if (t_.size_ == 2) {  // both parts, in the same order on both ranks
    const char* theirs = t_.base_ + t_.recv_offset(slot_, 0);
    bool agrees = true;
    if (check_) {  // (reduced as the check's own allreduce would: max)
      int64_t other[kCheckValues];
      std::memcpy(other, theirs, kCheckBytes);
      for (int i = 0; i < kCheckValues; ++i) check_[i] = std::max(check_[i], other[i]);
      agrees = check_agrees(check_);
    }
    const void* srcs[2] = {data + t_.head_, theirs + t_.head_};
    if (t_.rank_ == 1) std::swap(srcs[0], srcs[1]);
    if (agrees) reduce(dtype_, op_kind_, srcs, 2, user_, nullptr, n_, 1);
  } else if (agrees_) {
    copy_bytes(user_, data + t_.head_, n_ * es_);
  }
  t_.busy_[slot_] = false;
  done_ = true;
  return true;
}

bool Exchange::test() {
  if (done_) return true;
  const int P = t_.size_;
  for (;;) {
    if (step_ == t_.steps()) return finish();
    if (!posted_ && !post()) return blocked();
    const gaspi_notification_id_t id = t_.step_id(slot_, step_);
    gaspi_notification_id_t got = 0;
    gaspi_return_t rc = gaspi_notify_waitsome(t_.seg_, id, 1, &got, GASPI_TEST);
    if (rc == GASPI_TIMEOUT) return blocked();
    gaspi_notification_t old = 0;
    if (rc == GASPI_SUCCESS) rc = gaspi_notify_reset(t_.seg_, id, &old);
    if (rc != GASPI_SUCCESS)
      throw CollectiveError("gaspi_notify_waitsome/reset: " + gaspi_error(rc));
    if (old != value_)
      throw CollectiveError("GASPI notification " + std::to_string(id) + " from rank " +
                            std::to_string(t_.left_) + " belongs to another operation (" +
                            std::to_string(old) + ", expected " + std::to_string(value_) + ")");
    if (P > 2 && step_ < P - 1) {  // reduce the left neighbour's partial block into ours
      char* received = t_.base_ + t_.recv_offset(slot_, step_);
      if (check_) {  // its check so far into ours; sent on in front of the next block
        int64_t theirs[kCheckValues];
        std::memcpy(theirs, received, kCheckBytes);
        for (int i = 0; i < kCheckValues; ++i) running_[i] = std::max(running_[i], theirs[i]);
        std::memcpy(received, running_, kCheckBytes);
        if (step_ == P - 2) {  // (the max of every rank's)
          std::memcpy(check_, running_, kCheckBytes);
          agrees_ = check_agrees(check_);
        }
      }
      const int block = t_.mod(t_.rank_ - 1 - step_);
      char* mine = t_.base_ + t_.data_offset(slot_) + t_.head_ + block_offset(block);
      const void* srcs[2] = {mine, received + t_.head_};
      reduce(dtype_, op_kind_, srcs, 2, mine, nullptr, block_bytes(block) / es_, 1);
    }
    ++step_;
    posted_ = false;
  }
}

}  // namespace

bool gaspi_available() { return true; }

void gaspi_start(MPI_Comm world, int port, double timeout_s, const MpiWait& wait) {
  std::lock_guard<std::mutex> lock(runtime_mutex);
  auto b = std::make_unique<StartBuffers>();
  try {
    start_steps(world, port, timeout_s, wait, *b);
  } catch (...) {
    (void)b.release();  // a given-up MPI operation may still write into it
    throw;
  }
}

std::unique_ptr<Transport> make_gaspi_transport(MPI_Comm cross, std::vector<int> world_ranks,
                                                size_t max_bytes, double timeout_s,
                                                const MpiWait& wait) {
  return std::make_unique<GaspiTransport>(cross, std::move(world_ranks), max_bytes, timeout_s,
                                          wait);
}

}  // namespace tnt

#else  // built without GPI-2

namespace tnt {

bool gaspi_available() { return false; }

void gaspi_start(MPI_Comm, int, double, const MpiWait&) {
  throw std::logic_error("this build has no GASPI transport");
}

std::unique_ptr<Transport> make_gaspi_transport(MPI_Comm, std::vector<int>, size_t, double,
                                                const MpiWait&) {
  throw std::logic_error("this build has no GASPI transport");
}

}  // namespace tnt

#endif
