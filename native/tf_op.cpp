// The TensorFlow binding (as bindings.cpp is the Python one): the op TntAllreduce reduces one
// fusion bucket through the engine inside the training step's graph, so a step never enters
// Python; TntAllreduceStart and TntAllreduceFinish do the same in two halves; TntTimelineMark
// records a moment of the step for the timeline. Shipped as source and compiled on first use for
// the TensorFlow of the process that trains (tnt_notebook/keras/op_cache.py); without it the
// Keras wrapper reduces through tf.numpy_function. It needs TensorFlow's headers and tnt/c_api.h
// only: the engine is reached through that C table, which tnt_notebook hands to tnt_bind() right
// after loading this library.
#include <atomic>
#include <string>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tnt/c_api.h"

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;

namespace {

std::atomic<const tnt_c_api*> bound_api{nullptr};

absl::Status status_of(int code, const std::string& message) {
  switch (code) {
    case TNT_TIMEOUT:
      return absl::DeadlineExceededError(message);
    case TNT_RANK_LOST:
      return absl::UnavailableError(message);
    case TNT_ABORTED:
      return absl::AbortedError(message);
    case TNT_MISMATCH:
      return absl::InvalidArgumentError(message);
    case TNT_NO_ENGINE:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

// A kernel that calls the engine through the bound C API and reports its result as a status.
class EngineKernel : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) final {
    const tnt_c_api* api = bound_api.load(std::memory_order_acquire);
    OP_REQUIRES(ctx, api != nullptr,
                absl::FailedPreconditionError(
                    "TntAllreduce: the op library was loaded without tnt_notebook "
                    "(use tnt_notebook.keras.allreduce_op)"));
    char error[1024] = "";
    const int code = Call(ctx, *api, error, sizeof error);
    if (!ctx->status().ok()) return;
    OP_REQUIRES_OK(ctx, code == TNT_OK ? absl::OkStatus() : status_of(code, error));
  }

 protected:
  // Calls the engine and returns its TNT_* code; a failure before the call sets ctx's status.
  virtual int Call(OpKernelContext* ctx, const tnt_c_api& api, char* error, size_t size) = 0;
};

// The attributes of a bucket's call.
class BucketKernel : public EngineKernel {
 public:
  explicit BucketKernel(OpKernelConstruction* ctx) : EngineKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dtype_code", &dtype_code_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("op_code", &op_code_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("bucket", &bucket_));
  }

 protected:
  int dtype_code_ = 0, op_code_ = 0;
  int64_t bucket_ = -1;
};

// The pieces of the op's input list `inputs`, whose outputs (from output 0 on) are their inputs'
// buffers where TensorFlow lets us have them (gradients usually): a step then allocates (and
// page-faults) nothing for model-sized results. `first_input`: the list's first input index.
// False (with ctx's status set) on failure.
bool in_place_pieces(OpKernelContext* ctx, int first_input, std::vector<tnt_piece>* out) {
  tensorflow::OpInputList inputs;
  absl::Status status = ctx->input_list("inputs", &inputs);
  out->resize(inputs.size());
  for (int i = 0; status.ok() && i < inputs.size(); ++i) {
    tensorflow::Tensor* result = nullptr;
    status = ctx->forward_input_or_allocate_output({first_input + i}, i, inputs[i].shape(), &result);
    if (!status.ok()) break;
    auto in = inputs[i].tensor_data();
    (*out)[i] = tnt_piece{in.data(), const_cast<char*>(result->tensor_data().data()), in.size()};
  }
  if (!status.ok()) ctx->CtxFailure(status);
  return status.ok();
}

class TntAllreduce : public BucketKernel {
 public:
  using BucketKernel::BucketKernel;

 protected:
  int Call(OpKernelContext* ctx, const tnt_c_api& api, char* error, size_t size) override {
    std::vector<tnt_piece> pieces;
    if (!in_place_pieces(ctx, 0, &pieces)) return TNT_FAILED;
    return api.allreduce(pieces.data(), pieces.size(), dtype_code_, op_code_, bucket_, error, size);
  }
};

// TntAllreduce in two halves, so that backprop goes on while a bucket travels between hosts.
// The start reads the bucket and may post its exchange (the engine decides); it is cheap, so
// TensorFlow runs it inline as soon as the bucket's gradients exist. Its ticket goes to the
// finish, which takes the same tensors and writes the results.
class TntAllreduceStart : public BucketKernel {
 public:
  using BucketKernel::BucketKernel;
  bool IsExpensive() override { return false; }

 protected:
  int Call(OpKernelContext* ctx, const tnt_c_api& api, char* error, size_t size) override {
    tensorflow::OpInputList inputs;
    tensorflow::Tensor* ticket = nullptr;
    absl::Status status = ctx->input_list("inputs", &inputs);
    if (status.ok()) status = ctx->allocate_output(0, tensorflow::TensorShape({}), &ticket);
    if (!status.ok()) {
      ctx->CtxFailure(status);
      return TNT_FAILED;
    }
    std::vector<tnt_piece> pieces(inputs.size());
    for (int i = 0; i < inputs.size(); ++i) {
      auto in = inputs[i].tensor_data();
      pieces[i] = tnt_piece{in.data(), nullptr, in.size()};
    }
    return api.start_allreduce(pieces.data(), pieces.size(), dtype_code_, op_code_, bucket_,
                               &ticket->scalar<int64_t>()(), error, size);
  }
};

class TntAllreduceFinish : public EngineKernel {
 public:
  using EngineKernel::EngineKernel;

 protected:
  int Call(OpKernelContext* ctx, const tnt_c_api& api, char* error, size_t size) override {
    std::vector<tnt_piece> pieces;
    if (!in_place_pieces(ctx, 1, &pieces)) return TNT_FAILED;
    return api.finish_allreduce(ctx->input(0).scalar<int64_t>()(), pieces.data(), pieces.size(),
                                error, size);
  }
};

// A train step's mark in the timeline (see tnt_notebook/keras/timeline_recorder.py): records the
// time its inputs exist, while the timeline records, and passes them on unchanged, so that what
// uses its outputs runs after the mark. Cheap and inline.
class TntTimelineMark : public OpKernel {
 public:
  explicit TntTimelineMark(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("label", &label_));
  }
  bool IsExpensive() override { return false; }
  void Compute(OpKernelContext* ctx) override {
    const tnt_c_api* api = bound_api.load(std::memory_order_acquire);
    if (api != nullptr) api->mark(label_);
    for (int i = 0; i < ctx->num_inputs(); ++i) ctx->set_output(i, ctx->input(i));
  }

 private:
  int64_t label_ = 0;
};

}  // namespace

// Called once by tnt_notebook with the address from _native.c_api(); 0 on success.
extern "C" __attribute__((visibility("default"))) int tnt_bind(const tnt_c_api* api) {
  if (api == nullptr || api->version != TNT_C_API_VERSION) return -1;
  bound_api.store(api, std::memory_order_release);
  return 0;
}

REGISTER_OP("TntAllreduce")
    .Input("inputs: N * T")
    .Output("outputs: N * T")
    .Attr("T: {half, bfloat16, float, double, int32, int64}")
    .Attr("N: int >= 1")
    .Attr("dtype_code: int")
    .Attr("op_code: int")
    .Attr("bucket: int")
    .SetIsStateful()
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
      return absl::OkStatus();
    });

REGISTER_KERNEL_BUILDER(Name("TntAllreduce").Device(tensorflow::DEVICE_CPU), TntAllreduce);

REGISTER_OP("TntAllreduceStart")
    .Input("inputs: N * T")
    .Output("ticket: int64")
    .Attr("T: {half, bfloat16, float, double, int32, int64}")
    .Attr("N: int >= 1")
    .Attr("dtype_code: int")
    .Attr("op_code: int")
    .Attr("bucket: int")
    .SetIsStateful()
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    });

REGISTER_OP("TntAllreduceFinish")
    .Input("ticket: int64")
    .Input("inputs: N * T")
    .Output("outputs: N * T")
    .Attr("T: {half, bfloat16, float, double, int32, int64}")
    .Attr("N: int >= 1")
    .SetIsStateful()
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      for (int i = 1; i < c->num_inputs(); ++i) c->set_output(i - 1, c->input(i));
      return absl::OkStatus();
    });

REGISTER_KERNEL_BUILDER(Name("TntAllreduceStart").Device(tensorflow::DEVICE_CPU),
                        TntAllreduceStart);
REGISTER_KERNEL_BUILDER(Name("TntAllreduceFinish").Device(tensorflow::DEVICE_CPU),
                        TntAllreduceFinish);

REGISTER_OP("TntTimelineMark")
    .Input("inputs: T")
    .Output("outputs: T")
    .Attr("T: list(type) >= 1")
    .Attr("label: int")
    .SetIsStateful()
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
      return absl::OkStatus();
    });

REGISTER_KERNEL_BUILDER(Name("TntTimelineMark").Device(tensorflow::DEVICE_CPU), TntTimelineMark);
