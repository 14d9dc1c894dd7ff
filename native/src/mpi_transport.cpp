// The MPI transport between nodes (mpi_transport.hpp): one exchange as a plan of steps over
// point-to-point messages. Over 500 lines: the exchange's planning, posting and reducing of one
// state machine are read together.
#include "tnt/mpi_transport.hpp"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "tnt/errors.hpp"
#include "tnt/mpi_collectives.hpp"
#include "tnt/reduce.hpp"

namespace tnt {

namespace {

// What travels in front of a part in the recursive doubling.
struct Head {
  int64_t check[kCheckValues];  // max-reduced over the ranks summed up so far (zeros: unchecked)
  int64_t bytes;                // the sender's part
  int64_t agree;                // 1: those ranks all passed the same check and bytes
  int64_t pad[2];
};
static_assert(sizeof(Head) == 128, "a head keeps the data behind it 64-byte aligned");
constexpr size_t kHeadBytes = sizeof(Head);
// The most data in one message: a head fits in front of it.
constexpr size_t kFragmentData = kFragmentBytes - kHeadBytes;

// From this many nodes on, also where they are not a power of two, parts go by recursive halving
// and doubling rather than around a ring (see MpiExchange::plan_data).
constexpr int kHalvingNodes = 32;

// Exchanges started one after another use tags of their own (several are in flight at once);
// the codes tell an exchange's messages apart.
constexpr int kTagSlots = 4;
enum TagCode { kHeadTag = 0, kPartTag = 1, kRingTag = 2, kTagCodes = 3 };

// A failed message may belong to a peer that completed the exchange and left, or whose node-mate
// is about to tell why it is gone: it counts as a loss only if the exchange is still incomplete
// this long afterwards (the caller's wait meanwhile takes a better account, if one comes).
constexpr auto kLostGrace = std::chrono::seconds(1);

size_t fragments(size_t bytes) { return (bytes + kFragmentData - 1) / kFragmentData; }

// Fragment `i` of a message of `bytes` (offset, length): fragments of about equal sizes, each a
// multiple of 64 bytes but the last (64 KB go as two of 32 KB, not as 60 and 4).
std::pair<size_t, size_t> fragment(size_t bytes, size_t i) {
  const size_t k = fragments(bytes), q = ((bytes + k - 1) / k + 63) / 64 * 64;
  const size_t lo = std::min(i * q, bytes);
  return {lo, std::min(lo + q, bytes) - lo};
}

bool test_one(MPI_Request* req) {
  int done = 0;
  check_mpi(MPI_Test(req, &done, MPI_STATUS_IGNORE), "MPI_Test");
  return done != 0;
}

bool test_all(std::vector<MPI_Request>& reqs) {
  int done = 0;
  check_mpi(MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE),
            "MPI_Testall");
  return done != 0;
}

}  // namespace

class MpiExchange : public Pending {
 public:
  MpiExchange(MpiTransport& t, uint64_t seq, int64_t* check, const void* in, void* out, size_t n,
              DType dtype, Op op);
  ~MpiExchange() override;
  bool test() override;
  // Sends what can go at once and posts the first step.
  void begin();

 private:
  enum class Kind {  // (in this order: post and progress tell the heads' steps by it)
    // The heads' recursive doubling (with an inline part): the fold of a rank beyond the power
    // of two into its partner, the swaps, and the result back to the folded rank.
    fold_in, fold_out, swap, unfold,
    // Parts: swapped between 2 nodes; around a ring; or by recursive halving and doubling, whose
    // ranks beyond the power of two hand their part to a partner first and get the result last.
    pair, ring, part_fold_out, part_fold_in, halve, dbl, part_unfold_out, part_unfold_in,
  };
  struct Step {
    Kind kind;
    int peer;  // its rank in the exchange (ring: -1, the neighbours)
    int arg;   // ring: the step's index; halve, dbl: the distance in blocks (a power of two)
  };
  // What a data step receives: `bytes` at offset `at` of the part, into received() (fragment i at
  // i * kFragmentBytes) or straight into out_ + at; with `mine`, each fragment is reduced into
  // out_ + at as it arrives: op(mine, theirs), or op(theirs, mine) with `peer_first`.
  struct Incoming {
    size_t at = 0, bytes = 0;
    bool scratch = true;
    const char* mine = nullptr;
    bool peer_first = false;
    bool wait_send = false;  // (in place: our fragment of the same place must have left first)
    size_t reduced = 0;      // fragments below this are reduced
  };

  // The buffer: [our head | our inline part] [the peer's head | its inline part] [received data]
  Head& my_head() { return *reinterpret_cast<Head*>(buf_); }
  char* my_data() { return buf_ + kHeadBytes; }
  Head& peer_head() { return *reinterpret_cast<Head*>(buf_ + kFragmentBytes); }
  char* peer_data() { return buf_ + kFragmentBytes + kHeadBytes; }
  char* received() { return buf_ + 2 * kFragmentBytes; }
  int tag(TagCode code) const { return static_cast<int>(seq_ % kTagSlots) * kTagCodes + code; }
  int mod(int i) const { return ((i % t_.size_) + t_.size_) % t_.size_; }
  // The rank of a member of the power-of-two group (see plan_heads).
  int real(int newrank) const { return newrank < rem_ ? 2 * newrank + 1 : newrank + rem_; }
  // Elements [lo(j), lo(j + 1)) of the part form segment j (ring) or block j (halving).
  size_t lo(int j) const { return std::min(static_cast<size_t>(j) * seg_, n_); }
  static bool carries_part(int64_t bytes) { return static_cast<size_t>(bytes) <= kFragmentData; }

  void plan_heads();
  void plan_data();
  void start();
  bool advance();
  // Notes a failed MPI call: the exchange stops, and test() reports it after kLostGrace.
  void note_failure(const std::exception& e);
  // The world ranks this rank exchanges messages with in step `s`.
  std::string peers_of(const Step& s) const;
  void post(const Step& s);
  bool progress(const Step& s);  // false while the step's messages are incomplete
  void complete(const Step& s);
  void finish();
  void isend(std::vector<MPI_Request>& reqs, const void* data, size_t bytes, int peer,
             TagCode code);
  void irecv(std::vector<MPI_Request>& reqs, void* data, size_t bytes, int peer, TagCode code);
  // Fragments `first`.. of a message of `bytes`.
  void isend_fragments(const char* data, size_t bytes, size_t first, int peer, TagCode code);
  // Fragment `i` of a message of at most a fragment's size, into `received() + i * kFragmentBytes`
  // (where sizes may differ from ours, the space is the most that can come).
  void irecv_fragment(size_t i, int peer, TagCode code);
  // What `incoming_` describes, from `peer`, fragment by fragment.
  void irecv_incoming(int peer, TagCode code);
  // Receives segments or blocks [recv, recv + count) from `from` (incoming_ says where to) and
  // sends [send, send + count) of `data` to `to`.
  void move_blocks(int recv, int send, int count, const char* data, int from, int to,
                   TagCode code);
  // The peer's fragments of a checked part: received where its head says they come.
  void match_peer_part(int peer);
  // Reduces the peer's head (and inline part) into ours; the lower rank's elements go first.
  void combine(bool peer_lower, bool last);
  void reduce_into(void* dst, const void* a, const void* b, size_t n);

  MpiTransport& t_;
  uint64_t seq_;
  int64_t* check_;
  const char* in_;
  char* out_;
  size_t n_, es_, bytes_, seg_ = 0;
  DType dtype_;
  Op op_;
  bool inline_;  // our whole part travels with our head
  size_t head_data_ = 0;  // the bytes of our part behind our head
  char* buf_;
  int pof2_ = 1, rem_ = 0, newrank_ = 0;  // the power-of-two group (newrank_ -1: folded out)
  const char* src_;  // our part as the halving reads it: in_, or out_ once it holds sums
  std::vector<Step> steps_;
  size_t at_ = 0, heads_ = 0;  // the step in flight; how many steps exchange heads
  bool data_planned_ = false, in_out_ = false, done_ = false;
  int64_t peer_bytes_ = 0;
  std::vector<MPI_Request> head_reqs_, sends_, recvs_;  // recvs_: in fragment order
  Incoming incoming_;
  size_t next_ = 0;            // the next fragment of recvs_ to complete
  size_t peer_fragments_ = 0;  // 2 nodes: the fragments of the peer's part we receive
  std::string lost_;           // why MPI failed, if it did
  std::chrono::steady_clock::time_point lost_at_{};
};

MpiExchange::MpiExchange(MpiTransport& t, uint64_t seq, int64_t* check, const void* in,
                         void* out, size_t n, DType dtype, Op op)
    : t_(t),
      seq_(seq),
      check_(check),
      in_(static_cast<const char*>(in)),
      out_(static_cast<char*>(out)),
      n_(n),
      es_(dtype_size(dtype)),
      bytes_(n * dtype_size(dtype)),
      dtype_(dtype),
      op_(op),
      inline_(carries_part(static_cast<int64_t>(bytes_))),
      buf_(t.take_buffer()),
      src_(in_) {
  Head& h = my_head();
  std::memset(&h, 0, sizeof h);
  if (check_) std::copy(check_, check_ + kCheckValues, h.check);
  h.bytes = static_cast<int64_t>(bytes_);
  h.agree = 1;
  const int N = t_.size_, r = t_.rank_;
  while (pof2_ * 2 <= N) pof2_ *= 2;
  rem_ = N - pof2_;
  newrank_ = r < 2 * rem_ ? (r % 2 ? r / 2 : -1) : r - rem_;
  if (check_ || inline_) plan_heads();
}

MpiExchange::~MpiExchange() {
  if (done_)
    t_.give_back(buf_);
  else
    t_.abandon();  // MPI may still read and write the buffer: it is leaked
}

void MpiExchange::plan_heads() {
  const int r = t_.rank_;
  if (newrank_ < 0) {
    steps_.push_back({Kind::fold_out, r + 1, 0});
  } else {
    if (r < 2 * rem_) steps_.push_back({Kind::fold_in, r - 1, 0});
    for (int mask = 1; mask < pof2_; mask <<= 1)
      steps_.push_back({Kind::swap, real(newrank_ ^ mask), 0});
    if (r < 2 * rem_) steps_.push_back({Kind::unfold, r - 1, 0});
  }
  heads_ = steps_.size();
}

void MpiExchange::plan_data() {
  data_planned_ = true;
  const int N = t_.size_, r = t_.rank_;
  if (N == 2) {
    // (our part went out at begin; the peer's follows its head if it is not inline)
    if (!inline_ || !carries_part(peer_bytes_)) steps_.push_back({Kind::pair, 1 - r, 0});
    return;
  }
  if (inline_ || !my_head().agree) return;
  // A ring takes 2(N-1) steps, recursive halving and doubling 2 log2(N): on a power of two of 4
  // nodes or more both move 2(N-1)/N of the part per node and the halving is faster; otherwise
  // its ranks beyond the power of two move the whole part twice more, which only many nodes repay.
  if (rem_ == 0 ? N < 4 : N < kHalvingNodes) {
    seg_ = (n_ + static_cast<size_t>(N) - 1) / static_cast<size_t>(N);
    for (int k = 0; k < 2 * (N - 1); ++k) steps_.push_back({Kind::ring, -1, k});
    return;
  }
  seg_ = (n_ + static_cast<size_t>(pof2_) - 1) / static_cast<size_t>(pof2_);
  if (newrank_ < 0) {
    steps_.push_back({Kind::part_fold_out, r + 1, 0});
    steps_.push_back({Kind::part_unfold_in, r + 1, 0});
    return;
  }
  if (r < 2 * rem_) steps_.push_back({Kind::part_fold_in, r - 1, 0});
  for (int mask = pof2_ / 2; mask >= 1; mask >>= 1)
    steps_.push_back({Kind::halve, real(newrank_ ^ mask), mask});
  for (int mask = 1; mask < pof2_; mask <<= 1)
    steps_.push_back({Kind::dbl, real(newrank_ ^ mask), mask});
  if (r < 2 * rem_) steps_.push_back({Kind::part_unfold_out, r - 1, 0});
}

void MpiExchange::isend(std::vector<MPI_Request>& reqs, const void* data, size_t bytes, int peer,
                        TagCode code) {
  reqs.push_back(MPI_REQUEST_NULL);
  check_mpi(MPI_Isend(data, static_cast<int>(bytes), MPI_BYTE, peer, tag(code), t_.comm_,
                      &reqs.back()),
            "MPI_Isend");
}

void MpiExchange::irecv(std::vector<MPI_Request>& reqs, void* data, size_t bytes, int peer,
                        TagCode code) {
  reqs.push_back(MPI_REQUEST_NULL);
  check_mpi(MPI_Irecv(data, static_cast<int>(bytes), MPI_BYTE, peer, tag(code), t_.comm_,
                      &reqs.back()),
            "MPI_Irecv");
}

void MpiExchange::isend_fragments(const char* data, size_t bytes, size_t first, int peer,
                                  TagCode code) {
  for (size_t i = first; i < fragments(bytes); ++i) {
    const auto [at, len] = fragment(bytes, i);
    isend(sends_, data + at, len, peer, code);
  }
}

void MpiExchange::irecv_fragment(size_t i, int peer, TagCode code) {
  irecv(recvs_, received() + i * kFragmentBytes, kFragmentBytes, peer, code);
}

void MpiExchange::irecv_incoming(int peer, TagCode code) {
  const Incoming& x = incoming_;
  for (size_t i = 0; i < fragments(x.bytes); ++i) {
    if (x.scratch) {
      irecv_fragment(i, peer, code);
    } else {
      const auto [at, len] = fragment(x.bytes, i);
      irecv(recvs_, out_ + x.at + at, len, peer, code);
    }
  }
}

void MpiExchange::move_blocks(int recv, int send, int count, const char* data, int from, int to,
                              TagCode code) {
  incoming_.at = lo(recv) * es_;
  incoming_.bytes = (lo(recv + count) - lo(recv)) * es_;
  irecv_incoming(from, code);
  isend_fragments(data + lo(send) * es_, (lo(send + count) - lo(send)) * es_, 0, to, code);
}

void MpiExchange::begin() {
  try {
    start();
  } catch (const CollectiveError& e) {
    note_failure(e);
  }
}

void MpiExchange::note_failure(const std::exception& e) {
  if (!lost_.empty()) return;
  std::string mpi = e.what();
  mpi = mpi.substr(0, mpi.find('\n'));  // (MPICH appends its error stack)
  const Step* s = at_ < steps_.size() ? &steps_[at_] : nullptr;
  lost_ = "the messages to and from " + (s ? peers_of(*s) : std::string("the other nodes")) +
          " failed (" + mpi + "): its process or its host is gone";
  lost_at_ = std::chrono::steady_clock::now();
}

std::string MpiExchange::peers_of(const Step& s) const {
  auto name = [&](int i) { return std::to_string(t_.world_ranks_[static_cast<size_t>(i)]); };
  if (s.kind != Kind::ring) return "rank " + name(s.peer);
  const int left = mod(t_.rank_ - 1), right = mod(t_.rank_ + 1);
  return left == right ? "rank " + name(left) : "ranks " + name(left) + " and " + name(right);
}

void MpiExchange::start() {
  head_data_ = inline_ ? bytes_ : 0;
  if (t_.size_ == 2 && !inline_) {
    // Our part goes out at once, whatever the heads say, and the peer's is expected: with a
    // check, its first fragment travels behind our head, and match_peer_part fixes what the
    // peer's head contradicts.
    const int peer = 1 - t_.rank_;
    const size_t first = check_ ? 1 : 0;
    if (check_) {
      head_data_ = fragment(bytes_, 0).second;
      recvs_.push_back(MPI_REQUEST_NULL);
      sends_.push_back(MPI_REQUEST_NULL);
    }
    for (size_t i = first; i < fragments(bytes_); ++i) irecv_fragment(i, peer, kPartTag);
    isend_fragments(in_, bytes_, first, peer, kPartTag);
    peer_fragments_ = recvs_.size();
    if (!check_) peer_bytes_ = static_cast<int64_t>(bytes_);  // (unchecked: the same everywhere)
  }
  if (head_data_ > 0) copy_bytes(my_data(), in_, head_data_);
  if (heads_ == 0) plan_data();
  if (at_ < steps_.size())
    post(steps_[at_]);
  else
    finish();
}

void MpiExchange::match_peer_part(int peer) {
  if (static_cast<size_t>(peer_bytes_) > t_.max_bytes_ || peer_bytes_ < 0)
    throw CollectiveError("rank " + std::to_string(t_.world_ranks_[static_cast<size_t>(peer)]) +
                          " sends a part of " + std::to_string(peer_bytes_) +
                          " bytes, more than a round holds here (do all ranks use the same "
                          "TNT_SHM_SEGMENT_BYTES?)");
  // (its first fragment came with its head; a receive beyond its last one has matched nothing
  // and can be cancelled)
  const size_t theirs = std::max<size_t>(1, fragments(static_cast<size_t>(peer_bytes_)));
  if (recvs_.empty()) recvs_.push_back(MPI_REQUEST_NULL);
  for (size_t i = theirs; i < recvs_.size(); ++i) check_mpi(MPI_Cancel(&recvs_[i]), "MPI_Cancel");
  for (size_t i = recvs_.size(); i < theirs; ++i) irecv_fragment(i, peer, kPartTag);
  peer_fragments_ = theirs;
}

void MpiExchange::post(const Step& s) {
  const size_t head_msg = kHeadBytes + head_data_;
  head_reqs_.clear();
  if (s.kind > Kind::pair) {  // (the heads' steps post their own; the pair's went at begin)
    sends_.clear();
    recvs_.clear();
  }
  next_ = 0;
  incoming_ = Incoming{};
  Incoming& x = incoming_;
  switch (s.kind) {
    case Kind::fold_in:
      irecv(head_reqs_, &peer_head(), kFragmentBytes, s.peer, kHeadTag);
      break;
    case Kind::fold_out:
    case Kind::swap:
      irecv(head_reqs_, &peer_head(), kFragmentBytes, s.peer, kHeadTag);
      isend(head_reqs_, &my_head(), head_msg, s.peer, kHeadTag);
      break;
    case Kind::unfold:
      isend(head_reqs_, &my_head(), head_msg, s.peer, kHeadTag);
      break;
    case Kind::pair:
      if (check_) match_peer_part(s.peer);
      x.bytes = bytes_;
      if (my_head().agree && peer_bytes_ == static_cast<int64_t>(bytes_)) {
        x.mine = in_;
        x.peer_first = t_.rank_ == 1;  // (the lower rank's elements go first)
        x.wait_send = in_ == out_;
        x.reduced = peer_fragments_;
      }
      break;
    case Kind::ring: {
      const int N = t_.size_, r = t_.rank_, k = s.arg;
      const bool scatter = k < N - 1;
      const int send = scatter ? mod(r - k) : mod(r + 1 - (k - (N - 1)));
      const int recv = scatter ? mod(r - k - 1) : mod(r - (k - (N - 1)));
      x.scratch = scatter;  // (the allgather's fragments go straight to the output)
      move_blocks(recv, send, 1, k == 0 ? in_ : out_, mod(r - 1), mod(r + 1), kRingTag);
      if (scatter) x.mine = in_ + x.at;
      break;
    }
    case Kind::part_fold_out:
      isend_fragments(in_, bytes_, 0, s.peer, kPartTag);
      break;
    case Kind::part_fold_in:
      x.bytes = bytes_;
      x.mine = in_;
      x.peer_first = true;
      irecv_incoming(s.peer, kPartTag);
      break;
    case Kind::halve: {
      // Our blocks [base, base + 2 mask) halve: we keep the half on our side of the peer.
      const int m = s.arg, base = newrank_ & ~(2 * m - 1);
      const bool upper = (newrank_ & m) != 0;
      move_blocks(upper ? base + m : base, upper ? base : base + m, m, src_, s.peer, s.peer,
                  kPartTag);
      x.mine = src_ + x.at;
      break;
    }
    case Kind::dbl: {
      // Our blocks [mine, mine + mask) and the peer's beside them: the result of both.
      const int m = s.arg, mine = newrank_ & ~(m - 1);
      x.scratch = false;
      move_blocks(mine ^ m, mine, m, out_, s.peer, s.peer, kPartTag);
      break;
    }
    case Kind::part_unfold_out:
      isend_fragments(out_, bytes_, 0, s.peer, kPartTag);
      break;
    case Kind::part_unfold_in:
      x.bytes = bytes_;
      x.scratch = false;
      irecv_incoming(s.peer, kPartTag);
      break;
  }
}

void MpiExchange::reduce_into(void* dst, const void* a, const void* b, size_t n) {
  const void* srcs[2] = {a, b};
  reduce(dtype_, op_, srcs, 2, dst, nullptr, n, 1);
}

bool MpiExchange::progress(const Step& s) {
  if (s.kind < Kind::pair) return test_all(head_reqs_);  // (the heads' steps)
  // Fragments are reduced as they arrive, in order.
  const Incoming& x = incoming_;
  const size_t reduced = s.kind == Kind::pair ? x.reduced : recvs_.size();
  for (; next_ < recvs_.size(); ++next_) {
    if (!test_one(&recvs_[next_])) return false;
    if (!x.mine || next_ >= reduced) continue;
    if (x.wait_send && !test_one(&sends_[next_])) return false;
    const auto [at, len] = fragment(x.bytes, next_);
    const char* mine = x.mine + at;
    const char* theirs = s.kind == Kind::pair && check_ && next_ == 0
                             ? peer_data()  // (it came with the head)
                             : received() + next_ * kFragmentBytes;
    if (x.peer_first) std::swap(mine, theirs);
    reduce_into(out_ + x.at + at, mine, theirs, len / es_);
  }
  return test_all(sends_);
}

void MpiExchange::combine(bool peer_lower, bool last) {
  Head& me = my_head();
  const Head& peer = peer_head();
  const bool same = me.agree && peer.agree && me.bytes == peer.bytes &&
                    std::equal(me.check, me.check + kCheckValues, peer.check);
  for (int i = 0; i < kCheckValues; ++i) me.check[i] = std::max(me.check[i], peer.check[i]);
  me.agree = same ? 1 : 0;
  peer_bytes_ = peer.bytes;
  if (!same || !inline_ || n_ == 0) return;
  // The last reduction of a rank that passes nothing on goes straight to the output.
  char* dst = last ? out_ : my_data();
  in_out_ = last;
  if (peer_lower)
    reduce_into(dst, peer_data(), my_data(), n_);
  else
    reduce_into(dst, my_data(), peer_data(), n_);
}

void MpiExchange::complete(const Step& s) {
  switch (s.kind) {
    case Kind::fold_in:
      combine(true, false);
      break;
    case Kind::swap:
      combine(s.peer < t_.rank_, at_ + 1 == heads_);
      break;
    case Kind::fold_out: {  // the result, computed by our partner
      Head& me = my_head();
      const Head& peer = peer_head();
      std::copy(peer.check, peer.check + kCheckValues, me.check);
      me.agree = peer.agree;
      peer_bytes_ = peer.bytes;
      if (me.agree && inline_ && n_ > 0) {
        copy_bytes(out_, peer_data(), bytes_);
        in_out_ = true;
      }
      break;
    }
    case Kind::part_fold_in:
    case Kind::halve:
      src_ = out_;  // (it holds the sums of what we keep from here on)
      break;
    default:
      break;
  }
}

void MpiExchange::finish() {
  const Head& me = my_head();
  if (heads_ > 0 && inline_ && me.agree && !in_out_ && n_ > 0) copy_bytes(out_, my_data(), bytes_);
  if (t_.size_ == 1 && in_ != out_ && bytes_ > 0) copy_bytes(out_, in_, bytes_);
  if (check_) std::copy(me.check, me.check + kCheckValues, check_);
  done_ = true;
}

bool MpiExchange::test() {
  if (lost_.empty()) {
    try {
      return advance();
    } catch (const CollectiveError& e) {
      note_failure(e);
    }
  }
  if (std::chrono::steady_clock::now() - lost_at_ < kLostGrace) return false;
  throw RankLostError(lost_);
}

bool MpiExchange::advance() {
  while (!done_) {
    if (!progress(steps_[at_])) return false;
    complete(steps_[at_]);
    if (++at_ == heads_ && !data_planned_) plan_data();
    if (at_ < steps_.size())
      post(steps_[at_]);
    else
      finish();
  }
  return true;
}

// ---------------------------------------------------------------------------------------------

MpiTransport::MpiTransport(MPI_Comm comm, std::vector<int> world_ranks, size_t max_bytes)
    : comm_(comm), world_ranks_(std::move(world_ranks)), max_bytes_(max_bytes) {
  MPI_Comm_size(comm_, &size_);
  MPI_Comm_rank(comm_, &rank_);
  if (max_bytes_ > static_cast<size_t>(INT_MAX))
    throw CollectiveError("a round's part of more than 2 GiB cannot travel in one MPI message");
  buffer_bytes_ = (2 + fragments(max_bytes_)) * kFragmentBytes;
}

MpiTransport::~MpiTransport() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  for (char* b : free_) std::free(b);
  if (abandoned_ || finalized) return;
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

char* MpiTransport::take_buffer() {
  if (!free_.empty()) {
    char* b = free_.back();
    free_.pop_back();
    return b;
  }
  void* b = std::aligned_alloc(64, buffer_bytes_);
  if (!b) throw std::bad_alloc();
  return static_cast<char*>(b);
}

Pending* MpiTransport::start(int64_t* check, const void* in, void* out, size_t n, DType t, Op op) {
  if (abandoned_) throw CollectiveError("the exchange between nodes gave up an operation; rebuild it");
  if (n * dtype_size(t) > max_bytes_)
    throw CollectiveError("a part of " + std::to_string(n * dtype_size(t)) +
                          " bytes exceeds what an exchange between nodes carries (" +
                          std::to_string(max_bytes_) + ")");
  auto* x = new MpiExchange(*this, started_++, check, in, out, n, t, op);
  try {
    x->begin();
  } catch (...) {
    abandoned_ = true;  // (its messages may be in flight: the exchange is leaked)
    throw;
  }
  return x;
}

Pending* MpiTransport::start_allreduce(const void* in, void* out, size_t n, DType t, Op op) {
  return start(nullptr, in, out, n, t, op);
}

Pending* MpiTransport::start_checked_allreduce(int64_t* check, const void* in, void* out,
                                               size_t n, DType t, Op op) {
  return start(check, in, out, n, t, op);
}

}  // namespace tnt
