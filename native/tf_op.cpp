// The TensorFlow binding (as bindings.cpp is the Python one): the op TntAllreduce reduces one
// fusion bucket through the engine inside the training step's graph, so a step never enters
// Python. Shipped as source and compiled on first use for the TensorFlow of the process that
// trains (tnt_notebook/keras/op_cache.py); without it the Keras wrapper reduces through
// tf.numpy_function. It needs TensorFlow's headers and tnt/c_api.h only: the engine is reached
// through that C table, which tnt_notebook hands to tnt_bind() right after loading this library.
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

class TntAllreduce : public OpKernel {
 public:
  explicit TntAllreduce(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dtype_code", &dtype_code_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("op_code", &op_code_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("bucket", &bucket_));
  }

  void Compute(OpKernelContext* ctx) override {
    const tnt_c_api* api = bound_api.load(std::memory_order_acquire);
    OP_REQUIRES(ctx, api != nullptr,
                absl::FailedPreconditionError(
                    "TntAllreduce: the op library was loaded without tnt_notebook "
                    "(use tnt_notebook.keras.allreduce_op)"));
    tensorflow::OpInputList inputs;
    OP_REQUIRES_OK(ctx, ctx->input_list("inputs", &inputs));
    std::vector<tnt_piece> pieces(inputs.size());
    for (int i = 0; i < inputs.size(); ++i) {
      // In place when TensorFlow lets us have the input's buffer (gradients usually): a step then
      // allocates (and page-faults) nothing for model-sized results.
      tensorflow::Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({i}, i, inputs[i].shape(), &out));
      auto in = inputs[i].tensor_data();
      pieces[i] = tnt_piece{in.data(), const_cast<char*>(out->tensor_data().data()), in.size()};
    }
    char error[1024] = "";
    int code = api->allreduce(pieces.data(), pieces.size(), dtype_code_, op_code_, bucket_, error,
                              sizeof error);
    OP_REQUIRES_OK(ctx, code == TNT_OK ? absl::OkStatus() : status_of(code, error));
  }

 private:
  int dtype_code_ = 0, op_code_ = 0;
  int64_t bucket_ = -1;
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
