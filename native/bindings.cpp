// The only pybind11 file: exposes the engine, the fusion plan and the kernels as tnt_notebook._native.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tnt/c_api.hpp"
#include "tnt/engine.hpp"
#include "tnt/errors.hpp"
#include "tnt/gaspi_start.hpp"
#include "tnt/plan.hpp"
#include "tnt/reduce.hpp"
#include "tnt/shared_arrays.hpp"
#include "tnt/timeline.hpp"

namespace py = pybind11;
using namespace tnt;

namespace {

// Called by the waiting loops with the GIL released: runs Python's signal handlers, so that
// Ctrl-C (or ipyparallel's SIGINT) interrupts a rank stuck in a collective.
bool check_signals() {
  py::gil_scoped_acquire gil;
  return PyErr_CheckSignals() != 0;
}

// Keeps `arrays` alive for the life of the process when a failed collective was given up while
// MPI may still use their memory (Engine::allreduce's `caller_keeps_buffers`).
template <class F>
void pinning_on_failure(const Engine& e, std::initializer_list<py::handle> arrays, F&& fn) {
  try {
    fn();
  } catch (...) {
    if (e.abandoned())
      for (py::handle a : arrays) a.inc_ref();
    throw;
  }
}

PathPolicy to_path(const std::string& name) {
  if (name == "auto") return PathPolicy::automatic;
  if (name == "engine") return PathPolicy::engine;
  if (name == "mpi") return PathPolicy::mpi;
  throw py::value_error("allreduce path must be auto, engine or mpi, not " + name);
}

// Runs `fn` without the GIL; a pending Python exception raised by a signal handler is re-raised.
template <class F>
void without_gil(F&& fn) {
  bool interrupted = false;
  {
    py::gil_scoped_release release;
    try {
      fn();
    } catch (const Interrupted&) {
      interrupted = true;
    }
  }
  if (interrupted) throw py::error_already_set();
}

DType to_dtype(int code) {
  if (!valid_dtype(code)) throw py::type_error("unsupported dtype code " + std::to_string(code));
  return static_cast<DType>(code);
}
Op to_op(int code) {
  if (!valid_op(code)) throw py::value_error("unsupported op code " + std::to_string(code));
  return static_cast<Op>(code);
}

bool c_contiguous(const py::buffer_info& b) {
  py::ssize_t expect = b.itemsize;
  for (py::ssize_t i = b.ndim - 1; i >= 0; --i) {
    if (b.shape[i] != 1 && b.strides[i] != expect) return false;
    expect *= b.shape[i];
  }
  return true;
}

py::buffer_info request(const py::handle& obj, bool writable, DType t, const char* role) {
  py::buffer_info b = py::reinterpret_borrow<py::buffer>(obj).request(writable);
  if (!c_contiguous(b)) throw py::value_error(std::string(role) + " array is not C-contiguous");
  if (static_cast<size_t>(b.itemsize) != dtype_size(t))
    throw py::type_error(std::string(role) + " array item size does not match dtype " +
                         dtype_name(t));
  return b;
}

// Collects (input, output) buffers into pieces; the buffer_infos keep the views alive.
std::vector<Piece> pieces_of(const py::sequence& ins, const py::sequence& outs, DType t,
                             std::vector<py::buffer_info>& keep) {
  if (ins.size() != outs.size()) throw py::value_error("inputs and outputs differ in number");
  std::vector<Piece> pieces;
  pieces.reserve(ins.size());
  keep.reserve(2 * ins.size());
  for (size_t i = 0; i < ins.size(); ++i) {
    keep.push_back(request(ins[i], false, t, "input"));
    keep.push_back(request(outs[i], true, t, "output"));
    const auto& bi = keep[keep.size() - 2];
    const auto& bo = keep.back();
    if (bi.size != bo.size) throw py::value_error("input and output sizes differ");
    pieces.push_back(Piece{static_cast<const char*>(bi.ptr), static_cast<char*>(bo.ptr),
                           static_cast<size_t>(bi.size) * dtype_size(t)});
  }
  return pieces;
}

// A PathChoice's sites for Python, `names` saying what Path::engine and Path::mpi stand for.
py::list sites_of(const PathChoice& choice, const char* engine_name, const char* mpi_name) {
  py::list sites;
  for (const auto& [key, s] : choice.sites()) {
    py::dict d;
    d["count"] = std::get<0>(key);
    d["dtype"] = dtype_name(static_cast<DType>(std::get<1>(key)));
    d["op"] = op_name(static_cast<Op>(std::get<2>(key)));
    d["bucket"] = std::get<3>(key);
    d["calls"] = s.calls;
    d["decisions"] = s.decisions;
    d["path"] = s.chosen == Path::mpi ? mpi_name : engine_name;
    d[(std::string(engine_name) + "_s").c_str()] = s.seconds[0];
    d[(std::string(mpi_name) + "_s").c_str()] = s.seconds[1];
    sites.append(d);
  }
  return sites;
}

// A collective of the engine's CallRecord for Python (`which`: the record's oldest or last failed
// one), None if it has none.
py::object active_call(const CallRecord& r, bool (CallRecord::*which)(ActiveCall*) const) {
  ActiveCall a;
  if (!(r.*which)(&a)) return py::none();
  py::dict d;
  d["seq"] = a.seq;
  d["kind"] = a.kind;
  d["count"] = a.count;
  d["bytes"] = a.bytes;
  d["dtype"] = a.call.kind == Kind::allreduce ? dtype_name(a.call.dtype) : "";
  d["op"] = a.call.kind == Kind::allreduce ? op_name(a.call.op) : "";
  d["bucket"] = a.call.bucket;
  d["seconds"] =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - a.since).count();
  return std::move(d);
}

// The Python exception class of each TNT_* code (TNT_NO_ENGINE: the engine was closed, an abort),
// filled when the module loads.
py::handle error_classes[TNT_FAILED + 1];

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "tnt_notebook native core: shared-memory + MPI (or GASPI) fused allreduce engine";
  m.attr("__version__") = TNT_VERSION;

  py::dict dtypes, ops;
  for (int i = 0; i < kNumDTypes; ++i) dtypes[dtype_name(static_cast<DType>(i))] = i;
  for (int i = 0; i < kNumOps; ++i) ops[op_name(static_cast<Op>(i))] = i;
  m.attr("DTYPES") = dtypes;
  m.attr("OPS") = ops;
  std::vector<std::string> transports{"mpi"};
  if (gaspi_available()) transports.push_back("gaspi");
  m.attr("TRANSPORTS") = py::tuple(py::cast(transports));

  static py::exception<CollectiveError> collective_error(m, "CollectiveError", PyExc_RuntimeError);
  static py::handle timeout_error = PyErr_NewException(
      "tnt_notebook._native.CollectiveTimeoutError",
      py::make_tuple(collective_error, py::handle(PyExc_TimeoutError)).ptr(), nullptr);
  static py::handle lost_error =
      PyErr_NewException("tnt_notebook._native.RankLostError", collective_error.ptr(), nullptr);
  static py::handle aborted_error = PyErr_NewException(
      "tnt_notebook._native.CollectiveAbortedError", collective_error.ptr(), nullptr);
  static py::handle mismatch_error = PyErr_NewException(
      "tnt_notebook._native.CollectiveMismatchError",
      py::make_tuple(collective_error, py::handle(PyExc_ValueError)).ptr(), nullptr);
  m.attr("CollectiveTimeoutError") = timeout_error;
  m.attr("RankLostError") = lost_error;
  m.attr("CollectiveAbortedError") = aborted_error;
  m.attr("CollectiveMismatchError") = mismatch_error;
  error_classes[TNT_NO_ENGINE] = aborted_error;
  error_classes[TNT_TIMEOUT] = timeout_error;
  error_classes[TNT_RANK_LOST] = lost_error;
  error_classes[TNT_ABORTED] = aborted_error;
  error_classes[TNT_MISMATCH] = mismatch_error;
  error_classes[TNT_FAILED] = collective_error;
  for (int code = TNT_NO_ENGINE; code <= TNT_FAILED; ++code)
    set_c_api_error_name(code, error_classes[code].attr("__name__").cast<std::string>());
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const CollectiveError& e) {
      PyErr_SetString(error_classes[error_code(e)].ptr(), e.what());
    }
  });

  py::class_<Engine, std::shared_ptr<Engine>>(
      m, "Engine", "One process's collective engine (start() bootstraps it: a collective).")
      .def(py::init([](uintptr_t comm_address, int comm_handle_size, double timeout,
                       int ranks_per_node, size_t slot_bytes, int spin_us,
                       const std::string& path, const std::string& transport,
                       int gaspi_port) {
             if (comm_handle_size != static_cast<int>(sizeof(MPI_Comm)))
               throw py::type_error("mpi4py uses a different MPI ABI than tnt_notebook._native");
             int initialized = 0, finalized = 0;
             MPI_Initialized(&initialized);
             MPI_Finalized(&finalized);
             if (!initialized || finalized)
               throw py::value_error("MPI is not initialised (import mpi4py.MPI first)");
             if (timeout <= 0) throw py::value_error("timeout must be positive");
             if (transport != "mpi" && transport != "gaspi")
               throw py::value_error("unknown transport '" + transport + "' (mpi or gaspi)");
             if (transport == "gaspi" && !gaspi_available())
               throw py::value_error("this build has no GASPI transport (GPI-2 was not found "
                                     "when tnt_notebook was built)");
             if (gaspi_port != 0 && (gaspi_port < 1024 || gaspi_port > 65536 - kGaspiPortSpan))
               throw py::value_error("GASPI port " + std::to_string(gaspi_port) + " is not in 1024-" +
                                     std::to_string(65536 - kGaspiPortSpan));
             MPI_Comm world = *reinterpret_cast<MPI_Comm*>(comm_address);
             EngineOptions opt;
             opt.timeout_s = timeout;
             opt.ranks_per_node = ranks_per_node;
             opt.slot_bytes = slot_bytes;
             opt.spin_us = spin_us;
             opt.path = to_path(path);
             opt.transport = transport == "gaspi" ? TransportKind::gaspi : TransportKind::mpi;
             opt.gaspi_port = gaspi_port;
             return std::make_shared<Engine>(world, opt);
           }),
           py::arg("comm_address"), py::arg("comm_handle_size"), py::arg("timeout") = 30.0,
           py::arg("ranks_per_node") = 0, py::arg("slot_bytes") = 0, py::arg("spin_us") = -1,
           py::arg("path") = "auto", py::arg("transport") = "mpi", py::arg("gaspi_port") = 0)
      .def(
          "start",
          [](const std::shared_ptr<Engine>& e) {
            without_gil([&] { e->start(check_signals); });
            set_c_api_engine(e);
          },
          "Bootstraps the engine, or resumes the bootstrap that an interrupt or timeout left.")
      .def_property_readonly("ready", &Engine::ready)
      .def_property_readonly("bootstrapping", &Engine::bootstrapping,
                             "Started and suspended (interrupted or timed out): start() resumes it.")
      .def_property_readonly("usable", &Engine::usable,
                             "Bootstrapped, neither aborted nor closed: collectives may run.")
      .def_property_readonly("rank", &Engine::rank)
      .def_property_readonly("size", &Engine::size)
      .def_property_readonly("local_rank", &Engine::local_rank)
      .def_property_readonly("local_size", &Engine::local_size)
      .def_property_readonly("num_nodes", &Engine::num_nodes)
      .def_property_readonly("nparts", &Engine::nparts)
      .def_property_readonly("slot_bytes", &Engine::slot_bytes)
      .def_property_readonly("spin_microseconds", &Engine::spin_microseconds)
      .def_property_readonly("segment_name", &Engine::segment_name)
      .def_property_readonly(
          "transport",
          [](const Engine& e) { return e.transport() == TransportKind::gaspi ? "gaspi" : "mpi"; })
      .def_property_readonly("broken", &Engine::broken)
      .def_property_readonly(
          "path_sites", [](const Engine& e) { return sites_of(e.path_choice(), "engine", "mpi"); },
          "Per allreduce call site: its calls, the path chosen and the agreed probe medians.")
      .def_property_readonly(
          "posting_sites",
          [](const Engine& e) { return sites_of(e.posting_choice(), "whole", "posted"); },
          "Per batch of start_allreduce calls (keyed by its first call that may be posted): "
          "whether its starts post the exchanges or its finishes carry the calls out whole, and "
          "the agreed medians of the time spent in both.")
      .def_property_readonly("overlaps_exchanges", &Engine::overlaps_exchanges,
                             "Whether start_allreduce may post exchanges (several nodes).")
      .def_property_readonly("one_message_bytes", &Engine::one_message_bytes,
                             "The largest allreduce (bytes) sent with its check in one message "
                             "across nodes: the largest a start may post.")
      .def_property_readonly(
          "current_call",
          [](const Engine& e) { return active_call(e.calls(), &CallRecord::oldest); },
          "The oldest collective this rank is in now (any thread may ask while it runs): its "
          "number (the same call on every rank; 0: the engine's start-up), kind, count, bytes, "
          "dtype, op, bucket and seconds since it began; None between collectives.")
      .def_property_readonly(
          "failed_call",
          [](const Engine& e) { return active_call(e.calls(), &CallRecord::last_failed); },
          "The last collective that ended in an error (time-out, interrupt), as current_call "
          "says; None if none did.")
      .def_property_readonly(
          "calls_entered", [](const Engine& e) { return e.calls().entered(); },
          "How many collectives this engine has entered (the current one included).")
      .def_property_readonly("wait_seconds", &Engine::wait_seconds,
                             "Seconds this rank has spent waiting for local peers (diagnostic).")
      .def_property(
          "timeout", &Engine::timeout,
          [](Engine& e, double s) {
            if (s <= 0) throw py::value_error("timeout must be positive");
            e.set_timeout(s);
          })
      .def(
          "allreduce",
          [](Engine& e, const py::sequence& ins, const py::sequence& outs, int dtype, int op,
             int64_t bucket) {
            DType t = to_dtype(dtype);
            Op o = to_op(op);
            std::vector<py::buffer_info> keep;
            std::vector<Piece> pieces = pieces_of(ins, outs, t, keep);
            pinning_on_failure(e, {ins, outs}, [&] {
              without_gil([&] { e.allreduce(pieces, t, o, bucket, check_signals, true); });
            });
          },
          py::arg("inputs"), py::arg("outputs"), py::arg("dtype"), py::arg("op"),
          py::arg("bucket") = -1)
      .def(
          "allreduce1",
          [](Engine& e, const py::buffer& in, const py::buffer& out, int dtype, int op) {
            // the single-array fast path of allreduce (no sequences to unpack)
            DType t = to_dtype(dtype);
            Op o = to_op(op);
            py::buffer_info bi = request(in, false, t, "input");
            py::buffer_info bo = request(out, true, t, "output");
            // (the caller checks nothing on its fast path: tnt.allreduce says why in its terms)
            if (bi.shape != bo.shape || bi.format != bo.format)
              throw py::value_error("input and output differ in shape or element type");
            std::vector<Piece> pieces{Piece{static_cast<const char*>(bi.ptr),
                                            static_cast<char*>(bo.ptr),
                                            static_cast<size_t>(bi.size) * dtype_size(t)}};
            pinning_on_failure(e, {in, out}, [&] {
              without_gil([&] { e.allreduce(pieces, t, o, -1, check_signals, true); });
            });
          },
          py::arg("input"), py::arg("output"), py::arg("dtype"), py::arg("op"))
      .def(
          "start_allreduce",
          [](Engine& e, const py::sequence& ins, int dtype, int op, int64_t bucket) {
            DType t = to_dtype(dtype);
            Op o = to_op(op);
            std::vector<py::buffer_info> keep;
            std::vector<Piece> pieces;
            for (const auto& in : ins) {
              keep.push_back(request(in, false, t, "input"));
              pieces.push_back(Piece{static_cast<const char*>(keep.back().ptr), nullptr,
                                     static_cast<size_t>(keep.back().size) * dtype_size(t)});
            }
            int64_t ticket = 0;
            without_gil([&] { ticket = e.start_allreduce(pieces, t, o, bucket, check_signals); });
            return ticket;
          },
          py::arg("inputs"), py::arg("dtype"), py::arg("op"), py::arg("bucket") = -1,
          "The first half of allreduce (Engine::start_allreduce): returns a ticket.")
      .def(
          "finish_allreduce",
          [](Engine& e, int64_t ticket, const py::sequence& ins, const py::sequence& outs,
             int dtype) {
            std::vector<py::buffer_info> keep;
            std::vector<Piece> pieces = pieces_of(ins, outs, to_dtype(dtype), keep);
            without_gil([&] { e.finish_allreduce(ticket, pieces, check_signals); });
          },
          py::arg("ticket"), py::arg("inputs"), py::arg("outputs"), py::arg("dtype"),
          "The second half: the inputs as given to the start, unchanged since.")
      .def("barrier", [](Engine& e) { without_gil([&] { e.barrier(check_signals); }); })
      .def(
          "broadcast",
          [](Engine& e, const py::object& data, int root) {
            std::string buf;
            if (e.rank() == root) buf = py::bytes(data).cast<std::string>();
            without_gil([&] { e.broadcast(buf, root, check_signals); });
            return py::bytes(buf);
          },
          py::arg("data"), py::arg("root"))
      .def("close", &Engine::close)
      .def("abort", &Engine::abort, py::arg("reason"),
           "Make every rank's current or next collective raise CollectiveAbortedError.");

  // A shared array's memory (tnt.empty): the numpy array keeps it alive; freeing it gives the
  // block back for reuse (shared_arrays.hpp).
  struct SharedBlock {
    explicit SharedBlock(size_t n) : data(shared_alloc(n)), bytes(n) {}
    SharedBlock(const SharedBlock&) = delete;
    SharedBlock& operator=(const SharedBlock&) = delete;
    ~SharedBlock() { shared_free(data); }
    char* data;
    size_t bytes;
  };
  py::class_<SharedBlock>(m, "SharedBlock", py::buffer_protocol(),
                          "Memory the other ranks of the node can map (see tnt.empty).")
      .def(py::init<size_t>(), py::arg("bytes"))
      .def_buffer([](SharedBlock& b) {
        return py::buffer_info(b.data, 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.bytes)}, {1});
      });

  // The schedule that chooses each call site's path, on its own: the engine feeds it the times it
  // measures and agrees on across ranks; here a caller feeds it any times (path_choice.hpp).
  py::class_<PathChoice>(m, "PathChoice",
                         "Chooses the engine's path or MPI's per call site from measured times.")
      .def(py::init([](const std::string& policy) { return PathChoice(to_path(policy)); }),
           py::arg("policy") = "auto")
      .def(
          "next",
          [](PathChoice& c, const SiteKey& site) {
            bool timed = false;
            const Path p = c.next(site, &timed);
            return py::make_tuple(p == Path::mpi ? "mpi" : "engine", timed);
          },
          py::arg("site"), "(path, timed) of the next call at site (count, dtype, op, bucket).")
      .def(
          "record",
          [](PathChoice& c, const SiteKey& site, const std::string& path,
             double seconds) -> py::object {
            if (path != "mpi" && path != "engine")
              throw py::value_error("path must be engine or mpi, not " + path);
            double medians[2];
            if (!c.record(site, path == "mpi" ? Path::mpi : Path::engine, seconds, medians))
              return py::none();
            return py::make_tuple(medians[0], medians[1]);
          },
          py::arg("site"), py::arg("path"), py::arg("seconds"),
          "Records a timed call; at a window's end its medians (engine, mpi), to agree on.")
      .def(
          "decide",
          [](PathChoice& c, const SiteKey& site, double engine_s, double mpi_s) {
            const double agreed[2] = {engine_s, mpi_s};
            c.decide(site, agreed);
          },
          py::arg("site"), py::arg("engine_s"), py::arg("mpi_s"))
      .def_property_readonly(
          "sites", [](const PathChoice& c) { return sites_of(c, "engine", "mpi"); });

  m.def(
      "c_api", [] { return reinterpret_cast<uintptr_t>(c_api_table()); },
      "Address of the engine's C entry points (tnt/c_api.h), for the TensorFlow op library.");

  py::dict kinds, paths;  // the records' codes, by name (tnt/timeline.hpp's enums)
  kinds["whole"] = int64_t{timeline::kWhole};
  kinds["start"] = int64_t{timeline::kStart};
  kinds["finish"] = int64_t{timeline::kFinish};
  kinds["mark"] = int64_t{timeline::kMark};
  paths["engine"] = int64_t{timeline::kEngine};
  paths["mpi_allreduce"] = int64_t{timeline::kMpiAllreduce};
  paths["posted"] = int64_t{timeline::kPosted};
  m.attr("timeline_kinds") = kinds;
  m.attr("timeline_paths") = paths;
  m.def("timeline_recording", &timeline::set_recording, py::arg("on"),
        "Whether the collectives and the train step's marks are recorded for the timeline.");
  m.def(
      "timeline_take",
      [] {
        int64_t dropped = 0;
        const std::vector<timeline::Record> records = timeline::take(&dropped);
        py::array_t<int64_t> out({static_cast<py::ssize_t>(records.size()), py::ssize_t{6}});
        auto rows = out.mutable_unchecked<2>();
        for (size_t i = 0; i < records.size(); ++i) {
          const timeline::Record& r = records[i];
          const int64_t fields[6] = {r.kind, r.path, r.bucket, r.bytes, r.begin_ns, r.end_ns};
          for (py::ssize_t j = 0; j < 6; ++j) rows(i, j) = fields[j];
        }
        return py::make_tuple(out, dropped);
      },
      "The timeline's records since the last take, as rows (kind, path, bucket, bytes, begin_ns, "
      "end_ns) on time.monotonic_ns()'s clock, and how many were dropped (too many).");

  m.def(
      "fusion_plan",
      [](const std::vector<std::pair<std::vector<int64_t>, int>>& specs, size_t threshold) {
        std::vector<TensorSpec> ts;
        for (const auto& [shape, code] : specs) {
          for (int64_t d : shape)
            if (d < 0) throw py::value_error("negative dimension in tensor shape");
          ts.push_back(TensorSpec{shape, to_dtype(code)});
        }
        FusionPlan plan = make_fusion_plan(ts, threshold);
        return py::make_tuple(plan.buckets, plan.hash);
      },
      py::arg("specs"), py::arg("threshold_bytes"),
      "Groups tensors (shape, dtype code) into buckets; returns (buckets, hash).");

  m.def(
      "reduce",
      [](const py::sequence& srcs, const py::buffer& out, int dtype, int op, long divisor) {
        DType t = to_dtype(dtype);
        Op o = to_op(op);
        if (srcs.size() == 0) throw py::value_error("no sources");
        std::vector<py::buffer_info> keep;
        std::vector<const void*> ptrs;
        py::buffer_info bo = request(out, true, t, "output");
        for (const auto& s : srcs) {
          keep.push_back(request(s, false, t, "input"));
          if (keep.back().size != bo.size) throw py::value_error("sizes differ");
          ptrs.push_back(keep.back().ptr);
        }
        reduce(t, o, ptrs.data(), static_cast<int>(ptrs.size()), bo.ptr, nullptr,
               static_cast<size_t>(bo.size), divisor);
      },
      py::arg("sources"), py::arg("out"), py::arg("dtype"), py::arg("op"), py::arg("divisor") = 1,
      "Local kernel: out = op(sources...) (average divides by `divisor`).");
}
