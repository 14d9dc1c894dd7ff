#include "tnt/transport.hpp"

#include <memory>

namespace tnt {

bool check_agrees(const int64_t check[kCheckValues]) {
  for (int i = 0; i < kCheckValues / 2; ++i)
    if (check[i] != -check[kCheckValues / 2 + i]) return false;
  return check[5] == 0;  // (no node said that its ranks disagree)
}

std::string ranks_but(const std::vector<int>& world_ranks, int self) {
  std::string s;
  for (size_t i = 0; i < world_ranks.size(); ++i)
    if (static_cast<int>(i) != self) s += (s.empty() ? "" : ", ") + std::to_string(world_ranks[i]);
  return s.empty() ? "none" : s;
}

namespace {

// The check's allreduce, then the elements' if it agrees: two exchanges one after the other.
class CheckThenReduce : public Pending {
 public:
  CheckThenReduce(Transport& t, int64_t* check, const void* in, void* out, size_t n, DType dtype,
                  Op op)
      : t_(t), check_(check), in_(in), out_(out), n_(n), dtype_(dtype), op_(op) {
    step_.reset(t_.start_allreduce(check, check, kCheckValues, DType::i64, Op::max));
  }
  bool test() override {
    if (!step_->test()) return false;
    if (!check_) return true;  // (the elements' exchange, or none, is complete)
    const bool agrees = check_agrees(check_);
    check_ = nullptr;
    if (!agrees || n_ == 0) return true;
    step_.reset(t_.start_allreduce(in_, out_, n_, dtype_, op_));
    return step_->test();
  }

 private:
  Transport& t_;
  int64_t* check_;
  const void* in_;
  void* out_;
  size_t n_;
  DType dtype_;
  Op op_;
  std::unique_ptr<Pending> step_;
};

}  // namespace

Pending* Transport::start_checked_allreduce(int64_t* check, const void* in, void* out, size_t n,
                                            DType t, Op op) {
  return new CheckThenReduce(*this, check, in, out, n, t, op);
}

}  // namespace tnt
