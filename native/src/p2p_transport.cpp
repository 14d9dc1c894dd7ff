#include "tnt/p2p_transport.hpp"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "tnt/errors.hpp"
#include "tnt/mpi_transport.hpp"
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

class P2pExchange : public Pending {
 public:
  P2pExchange(P2pTransport& t, uint64_t seq, int64_t* check, const void* in, void* out, size_t n,
              DType dtype, Op op);
  ~P2pExchange() override;
  bool test() override;
  // Sends what can go at once and posts the first step.
  void begin();

 private:
  enum class Kind { fold_in, fold_out, swap, unfold, pair, ring };
  struct Step {
    Kind kind;
    int arg;  // the peer's rank in the exchange; ring: the step's index
  };

  // The buffer: [our head | our inline part] [the peer's head | its inline part] [received data]
  Head& my_head() { return *reinterpret_cast<Head*>(buf_); }
  char* my_data() { return buf_ + kHeadBytes; }
  Head& peer_head() { return *reinterpret_cast<Head*>(buf_ + kFragmentBytes); }
  char* peer_data() { return buf_ + kFragmentBytes + kHeadBytes; }
  char* received() { return buf_ + 2 * kFragmentBytes; }
  int tag(TagCode code) const { return static_cast<int>(seq_ % kTagSlots) * kTagCodes + code; }
  int mod(int i) const { return ((i % t_.size_) + t_.size_) % t_.size_; }
  size_t seg_lo(int j) const { return std::min(static_cast<size_t>(j) * seg_, n_); }
  size_t seg_len(int j) const { return seg_lo(j + 1) - seg_lo(j); }
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
  void isend_fragments(std::vector<MPI_Request>& reqs, const char* data, size_t bytes,
                       size_t first, int peer, TagCode code);
  // Fragment `i` of a message of at most a fragment's size, into `received() + i * kFragmentBytes`
  // (where sizes may differ from ours, the space is the most that can come).
  void irecv_fragment(size_t i, int peer, TagCode code);
  // The peer's fragments of a checked part: received where its head says they come.
  void match_peer_part(int peer);
  // Reduces the peer's head (and inline part) into ours; the lower rank's elements go first.
  void combine(bool peer_lower, bool last);
  void reduce_into(void* dst, const void* a, const void* b, size_t n);

  P2pTransport& t_;
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
  std::vector<Step> steps_;
  size_t at_ = 0, heads_ = 0;  // the step in flight; how many steps exchange heads
  bool data_planned_ = false, in_out_ = false, done_ = false;
  int64_t peer_bytes_ = 0;
  std::vector<MPI_Request> head_reqs_, sends_, recvs_;  // recvs_: in fragment order
  size_t next_ = 0;          // the next fragment of recvs_ to complete
  size_t peer_fragments_ = 0;  // 2 nodes: the fragments of the peer's part we receive
  std::string lost_;         // why MPI failed, if it did
  std::chrono::steady_clock::time_point lost_at_{};
};

P2pExchange::P2pExchange(P2pTransport& t, uint64_t seq, int64_t* check, const void* in,
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
      buf_(t.take_buffer()) {
  Head& h = my_head();
  std::memset(&h, 0, sizeof h);
  if (check_) std::copy(check_, check_ + kCheckValues, h.check);
  h.bytes = static_cast<int64_t>(bytes_);
  h.agree = 1;
  if (check_ || inline_) plan_heads();
}

P2pExchange::~P2pExchange() {
  if (done_)
    t_.give_back(buf_);
  else
    t_.abandon();  // MPI may still read and write the buffer: it is leaked
}

void P2pExchange::plan_heads() {
  const int N = t_.size_, r = t_.rank_;
  int pof2 = 1;
  while (pof2 * 2 <= N) pof2 *= 2;
  const int rem = N - pof2;
  int newrank = r - rem;
  if (r < 2 * rem) {
    if (r % 2 == 0) {
      steps_.push_back({Kind::fold_out, r + 1});
      heads_ = steps_.size();
      return;
    }
    steps_.push_back({Kind::fold_in, r - 1});
    newrank = r / 2;
  }
  for (int mask = 1; mask < pof2; mask <<= 1) {
    const int p = newrank ^ mask;
    steps_.push_back({Kind::swap, p < rem ? 2 * p + 1 : p + rem});
  }
  if (r < 2 * rem) steps_.push_back({Kind::unfold, r - 1});
  heads_ = steps_.size();
}

void P2pExchange::plan_data() {
  data_planned_ = true;
  const int N = t_.size_;
  if (N == 2) {
    // (our part went out at begin; the peer's follows its head if it is not inline)
    if (!inline_ || !carries_part(peer_bytes_)) steps_.push_back({Kind::pair, 1 - t_.rank_});
  } else if (!inline_ && my_head().agree) {
    seg_ = (n_ + static_cast<size_t>(N) - 1) / static_cast<size_t>(N);
    for (int s = 0; s < 2 * (N - 1); ++s) steps_.push_back({Kind::ring, s});
  }
}

void P2pExchange::isend(std::vector<MPI_Request>& reqs, const void* data, size_t bytes, int peer,
                        TagCode code) {
  reqs.push_back(MPI_REQUEST_NULL);
  check_mpi(MPI_Isend(data, static_cast<int>(bytes), MPI_BYTE, peer, tag(code), t_.comm_,
                      &reqs.back()),
            "MPI_Isend");
}

void P2pExchange::irecv(std::vector<MPI_Request>& reqs, void* data, size_t bytes, int peer,
                        TagCode code) {
  reqs.push_back(MPI_REQUEST_NULL);
  check_mpi(MPI_Irecv(data, static_cast<int>(bytes), MPI_BYTE, peer, tag(code), t_.comm_,
                      &reqs.back()),
            "MPI_Irecv");
}

void P2pExchange::isend_fragments(std::vector<MPI_Request>& reqs, const char* data, size_t bytes,
                                  size_t first, int peer, TagCode code) {
  for (size_t i = first; i < fragments(bytes); ++i) {
    const auto [at, len] = fragment(bytes, i);
    isend(reqs, data + at, len, peer, code);
  }
}

void P2pExchange::irecv_fragment(size_t i, int peer, TagCode code) {
  irecv(recvs_, received() + i * kFragmentBytes, kFragmentBytes, peer, code);
}

void P2pExchange::begin() {
  try {
    start();
  } catch (const CollectiveError& e) {
    note_failure(e);
  }
}

void P2pExchange::note_failure(const std::exception& e) {
  if (!lost_.empty()) return;
  std::string mpi = e.what();
  mpi = mpi.substr(0, mpi.find('\n'));  // (MPICH appends its error stack)
  const Step* s = at_ < steps_.size() ? &steps_[at_] : nullptr;
  lost_ = "the messages to and from " + (s ? peers_of(*s) : std::string("the other nodes")) +
          " failed (" + mpi + "): its process or its host is gone";
  lost_at_ = std::chrono::steady_clock::now();
}

std::string P2pExchange::peers_of(const Step& s) const {
  auto name = [&](int i) { return std::to_string(t_.world_ranks_[static_cast<size_t>(i)]); };
  if (s.kind != Kind::ring) return "rank " + name(s.arg);
  const int left = mod(t_.rank_ - 1), right = mod(t_.rank_ + 1);
  return left == right ? "rank " + name(left) : "ranks " + name(left) + " and " + name(right);
}

void P2pExchange::start() {
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
    isend_fragments(sends_, in_, bytes_, first, peer, kPartTag);
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

void P2pExchange::match_peer_part(int peer) {
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

void P2pExchange::post(const Step& s) {
  const size_t head_msg = kHeadBytes + head_data_;
  head_reqs_.clear();
  switch (s.kind) {
    case Kind::fold_in:
      irecv(head_reqs_, &peer_head(), kFragmentBytes, s.arg, kHeadTag);
      break;
    case Kind::fold_out:
    case Kind::swap:
      irecv(head_reqs_, &peer_head(), kFragmentBytes, s.arg, kHeadTag);
      isend(head_reqs_, &my_head(), head_msg, s.arg, kHeadTag);
      break;
    case Kind::unfold:
      isend(head_reqs_, &my_head(), head_msg, s.arg, kHeadTag);
      break;
    case Kind::pair:
      next_ = 0;
      if (check_) match_peer_part(s.arg);
      break;
    case Kind::ring: {
      const int N = t_.size_, r = t_.rank_, k = s.arg;
      const bool scatter = k < N - 1;
      const int send = scatter ? mod(r - k) : mod(r + 1 - (k - (N - 1)));
      const int recv = scatter ? mod(r - k - 1) : mod(r - (k - (N - 1)));
      sends_.clear();
      recvs_.clear();
      next_ = 0;
      const size_t bytes = seg_len(recv) * es_;
      for (size_t i = 0; i < fragments(bytes); ++i) {
        if (scatter) {
          irecv_fragment(i, mod(r - 1), kRingTag);
        } else {  // (the allgather's fragments go straight to the output)
          const auto [at, len] = fragment(bytes, i);
          irecv(recvs_, out_ + seg_lo(recv) * es_ + at, len, mod(r - 1), kRingTag);
        }
      }
      isend_fragments(sends_, (k == 0 ? in_ : out_) + seg_lo(send) * es_, seg_len(send) * es_, 0,
                      mod(r + 1), kRingTag);
      break;
    }
  }
}

void P2pExchange::reduce_into(void* dst, const void* a, const void* b, size_t n) {
  const void* srcs[2] = {a, b};
  reduce(dtype_, op_, srcs, 2, dst, nullptr, n, 1);
}

bool P2pExchange::progress(const Step& s) {
  if (s.kind != Kind::pair && s.kind != Kind::ring) return test_all(head_reqs_);
  // Fragments are reduced as they arrive, in order.
  const bool pair = s.kind == Kind::pair;
  const bool reducing = pair ? my_head().agree && peer_bytes_ == static_cast<int64_t>(bytes_)
                             : s.arg < t_.size_ - 1;
  const size_t seg = pair ? 0 : seg_lo(mod(t_.rank_ - s.arg - 1)) * es_;
  const size_t total = pair ? bytes_ : seg_len(mod(t_.rank_ - s.arg - 1)) * es_;
  for (; next_ < recvs_.size(); ++next_) {
    if (!test_one(&recvs_[next_])) return false;
    if (!reducing || (pair && next_ >= peer_fragments_)) continue;
    // (in place, our fragment must have left before its result overwrites it)
    if (pair && in_ == out_ && !test_one(&sends_[next_])) return false;
    const auto [at, len] = fragment(total, next_);
    const char* mine = in_ + seg + at;
    const char* theirs = pair && check_ && next_ == 0 ? peer_data()  // (it came with the head)
                                                      : received() + next_ * kFragmentBytes;
    if (pair && t_.rank_ == 1) std::swap(mine, theirs);
    reduce_into(out_ + seg + at, mine, theirs, len / es_);
  }
  return test_all(sends_);
}

void P2pExchange::combine(bool peer_lower, bool last) {
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

void P2pExchange::complete(const Step& s) {
  switch (s.kind) {
    case Kind::fold_in:
      combine(true, false);
      break;
    case Kind::swap:
      combine(s.arg < t_.rank_, at_ + 1 == heads_);
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
    case Kind::unfold:
    case Kind::pair:
    case Kind::ring:
      break;
  }
}

void P2pExchange::finish() {
  const Head& me = my_head();
  if (heads_ > 0 && inline_ && me.agree && !in_out_ && n_ > 0) copy_bytes(out_, my_data(), bytes_);
  if (t_.size_ == 1 && in_ != out_ && bytes_ > 0) copy_bytes(out_, in_, bytes_);
  if (check_) std::copy(me.check, me.check + kCheckValues, check_);
  done_ = true;
}

bool P2pExchange::test() {
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

bool P2pExchange::advance() {
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

P2pTransport::P2pTransport(MPI_Comm comm, std::vector<int> world_ranks, size_t max_bytes)
    : comm_(comm), world_ranks_(std::move(world_ranks)), max_bytes_(max_bytes) {
  MPI_Comm_size(comm_, &size_);
  MPI_Comm_rank(comm_, &rank_);
  if (max_bytes_ > static_cast<size_t>(INT_MAX))
    throw CollectiveError("a round's part of more than 2 GiB cannot travel in one MPI message");
  buffer_bytes_ = (2 + fragments(max_bytes_)) * kFragmentBytes;
}

P2pTransport::~P2pTransport() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  for (char* b : free_) std::free(b);
  if (abandoned_ || finalized) return;
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

char* P2pTransport::take_buffer() {
  if (!free_.empty()) {
    char* b = free_.back();
    free_.pop_back();
    return b;
  }
  void* b = std::aligned_alloc(64, buffer_bytes_);
  if (!b) throw std::bad_alloc();
  return static_cast<char*>(b);
}

Pending* P2pTransport::start(int64_t* check, const void* in, void* out, size_t n, DType t, Op op) {
  if (abandoned_) throw CollectiveError("the exchange between nodes gave up an operation; rebuild it");
  if (n * dtype_size(t) > max_bytes_)
    throw CollectiveError("a part of " + std::to_string(n * dtype_size(t)) +
                          " bytes exceeds what an exchange between nodes carries (" +
                          std::to_string(max_bytes_) + ")");
  auto* x = new P2pExchange(*this, started_++, check, in, out, n, t, op);
  try {
    x->begin();
  } catch (...) {
    abandoned_ = true;  // (its messages may be in flight: the exchange is leaked)
    throw;
  }
  return x;
}

Pending* P2pTransport::start_allreduce(const void* in, void* out, size_t n, DType t, Op op) {
  return start(nullptr, in, out, n, t, op);
}

Pending* P2pTransport::start_checked_allreduce(int64_t* check, const void* in, void* out,
                                               size_t n, DType t, Op op) {
  return start(check, in, out, n, t, op);
}

}  // namespace tnt
