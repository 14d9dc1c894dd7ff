// The TensorFlow op's C table (tnt/c_api.h): the engine's allreduce for a native library that
// cannot link to the Python module. No Python on this path (the op calls it from TensorFlow's
// threads), so no interrupt check either; the collective timeout bounds every wait.
#include "tnt/c_api.hpp"
#include "tnt/timeline.hpp"

#include <cstdint>
#include <cstdio>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <vector>

namespace tnt {
namespace {

std::mutex current_engine_mutex;
std::weak_ptr<Engine> current_engine;

// Indexed by TNT_* code (TNT_NO_ENGINE: the engine was closed, an abort).
std::string error_names[TNT_FAILED + 1];

const InterruptCheck kNoInterrupt = [] { return false; };

// Runs `body` on the current engine with the caller's pieces; returns its TNT_* code, with the
// message in `error`.
template <class Body>
int c_call(const tnt_piece* pieces, size_t n, char* error, size_t error_size, Body body) {
  auto fail = [&](int code, const char* what) {
    if (error_size > 0) std::snprintf(error, error_size, "%s: %s", error_names[code].c_str(), what);
    return code;
  };
  std::shared_ptr<Engine> engine;
  {
    std::lock_guard<std::mutex> lock(current_engine_mutex);
    engine = current_engine.lock();
  }
  if (!engine) return fail(TNT_NO_ENGINE, "no collective engine in this process (it was closed)");
  std::vector<Piece> ps;
  ps.reserve(n);
  for (size_t i = 0; i < n; ++i)
    ps.push_back(Piece{static_cast<const char*>(pieces[i].in), static_cast<char*>(pieces[i].out),
                       pieces[i].bytes});
  try {
    body(*engine, ps);
    return TNT_OK;
  } catch (const CollectiveError& e) {
    return fail(error_code(e), e.what());
  } catch (const std::exception& e) {
    return fail(TNT_FAILED, e.what());
  }
}

// The failure of a call whose dtype or op code is not one of _native.DTYPES / OPS.
int unsupported_codes(char* error, size_t error_size) {
  return c_call(nullptr, 0, error, error_size, [](Engine&, std::vector<Piece>&) {
    throw std::invalid_argument("unsupported dtype or op code");
  });
}

int c_allreduce(const tnt_piece* pieces, size_t n, int dtype, int op, int64_t bucket, char* error,
                size_t error_size) {
  if (!valid_dtype(dtype) || !valid_op(op)) return unsupported_codes(error, error_size);
  return c_call(pieces, n, error, error_size, [&](Engine& e, std::vector<Piece>& ps) {
    e.allreduce(ps, static_cast<DType>(dtype), static_cast<Op>(op), bucket, kNoInterrupt);
  });
}

int c_start_allreduce(const tnt_piece* pieces, size_t n, int dtype, int op, int64_t bucket,
                      int64_t* ticket, char* error, size_t error_size) {
  if (!valid_dtype(dtype) || !valid_op(op)) return unsupported_codes(error, error_size);
  return c_call(pieces, n, error, error_size, [&](Engine& e, std::vector<Piece>& ps) {
    *ticket = e.start_allreduce(ps, static_cast<DType>(dtype), static_cast<Op>(op), bucket,
                                kNoInterrupt);
  });
}

int c_finish_allreduce(int64_t ticket, const tnt_piece* pieces, size_t n, char* error,
                       size_t error_size) {
  return c_call(pieces, n, error, error_size, [&](Engine& e, std::vector<Piece>& ps) {
    e.finish_allreduce(ticket, ps, kNoInterrupt);
  });
}

void c_mark(int64_t label) {
  if (!timeline::recording()) return;
  const int64_t now = timeline::now_ns();
  timeline::record({timeline::kMark, label, -1, 0, now, now});
}

const tnt_c_api table{TNT_C_API_VERSION, c_allreduce, c_start_allreduce, c_finish_allreduce,
                      c_mark};

}  // namespace

int error_code(const CollectiveError& e) {
  if (dynamic_cast<const TimeoutError*>(&e)) return TNT_TIMEOUT;
  if (dynamic_cast<const RankLostError*>(&e)) return TNT_RANK_LOST;
  if (dynamic_cast<const AbortedError*>(&e)) return TNT_ABORTED;
  if (dynamic_cast<const MismatchError*>(&e)) return TNT_MISMATCH;
  return TNT_FAILED;
}

void set_c_api_engine(const std::shared_ptr<Engine>& engine) {
  std::lock_guard<std::mutex> lock(current_engine_mutex);
  current_engine = engine;
}

void set_c_api_error_name(int code, const std::string& name) { error_names[code] = name; }

const tnt_c_api* c_api_table() { return &table; }

}  // namespace tnt
