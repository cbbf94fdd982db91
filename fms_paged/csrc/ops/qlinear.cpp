// The operator fms_paged::qlinear: x [..., K] @ W^T (+ bias) for weights held as GGUF blocks
// (Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K: a contiguous uint8 tensor [N, K / block values, block
// bytes], the blocks as llama.cpp writes them: kernels/qgemv_blocks.h), by the qgemv kernel
// (kernels/qgemv.cpp: x quantized to int8 per block of 32, integer dot products) for any number of rows: decode and prefill read the same blocks, and no
// full-precision copy of the weight exists. The module that calls it is
// fms_paged/modules/quantized.py BlockLinear; the one-call forward (ops/layer.cpp) calls the
// kernel itself (run_qgemv) for a block's projections held so.
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "ops.h"

namespace fms_paged_ops {

int block_type(const at::Tensor& w) {
  if (!w.defined() || w.scalar_type() != at::kByte || w.dim() != 3 || !w.is_cpu() || !w.is_contiguous()) return 0;
  return fms_gguf::type_of_bytes(w.size(2));
}

void run_qgemv(KernelFn fn, int e, const void* x, int64_t M, int64_t K, int64_t x_st, const void* const* weights,
               const int64_t* rows, const int32_t* types, int64_t n_weights, void* y) {
  by_elem(e, [&](auto t) {
    using T = decltype(t);
    QgemvArgs<T> a{};
    a.x = static_cast<const T*>(x), a.M = M, a.K = K, a.x_st = x_st;
    a.weights = reinterpret_cast<const int8_t* const*>(weights), a.rows = rows, a.types = types;
    a.n_weights = n_weights, a.y = static_cast<T*>(y), a.threads = threads();
    const int err = timed([&] { return fn(&a); });
    TORCH_CHECK_VALUE(err == 0, "qgemv: the kernel takes Q8_0, Q4_0 and Q5_0 blocks with K a multiple of 32 and "
                      "Q4_K, Q5_K and Q6_K blocks with K a multiple of 256, got K=", K);
  });
}

// qlinear: [m(x) for the weights] side by side, + bias [sum N] (or None)
at::Tensor qlinear(const at::Tensor& x, at::TensorList weights, const std::optional<at::Tensor>& bias) {
  const int e = elem_index(x.scalar_type());
  TORCH_CHECK_VALUE(e >= 0 && x.is_cpu() && x.dim() > 0, "qlinear: x must be a CPU tensor [..., K] of ", elem_names,
                    ", got ", dtype_name(x.scalar_type()), " ", shape(x), " on ", x.device());
  TORCH_CHECK_VALUE(!weights.empty(), "qlinear: no weights");
  const int64_t K = x.size(-1);
  std::vector<const void*> ptrs;
  std::vector<int64_t> rows;
  std::vector<int32_t> types;
  int64_t width = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    const int type = block_type(w);
    TORCH_CHECK_VALUE(type && block_cols(w) == K, "qlinear: weight ", i, " must be GGUF blocks of x's width ", K,
                      ": a contiguous torch.uint8 CPU tensor [N, ", K / 32, ", 34 / 18 / 22] (Q8_0 / Q4_0 / Q5_0) or [N, ",
                      K / 256, ", 144 / 176 / 210] (Q4_K / Q5_K / Q6_K), got ", dtype_name(w.scalar_type()), " ",
                      shape(w), " on ", w.device());
    ptrs.push_back(w.data_ptr()), rows.push_back(w.size(0)), types.push_back(type);
    width += w.size(0);
  }
  const KernelFn fn = qgemv_fn(e);
  TORCH_CHECK(fn, "qlinear: no qgemv kernel loaded for ", dtype_name(x.scalar_type()),
              " (fms_paged.native.load_qgemv loads it)");
  const at::Tensor rows2d = x.reshape({-1, K}).contiguous();
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = width;
  at::Tensor y = at::empty(out_shape, x.options());
  if (rows2d.size(0))
    run_qgemv(fn, e, rows2d.data_ptr(), rows2d.size(0), K, K, ptrs.data(), rows.data(), types.data(),
              (int64_t)ptrs.size(), y.data_ptr());
  return bias ? at::add(y, *bias) : y;
}

at::Tensor block_embedding(const at::Tensor& blocks, const at::Tensor& tokens, at::ScalarType dtype) {
  const int type = block_type(blocks);
  TORCH_CHECK_VALUE(type && tokens.scalar_type() == at::kLong, "block_embedding: GGUF blocks and int64 tokens, got ",
                    dtype_name(blocks.scalar_type()), " ", shape(blocks), " and ", dtype_name(tokens.scalar_type()));
  const int64_t V = blocks.size(0), bb = blocks.size(2), C = block_cols(blocks), nb = C / 32;
  const at::Tensor tok = tokens.contiguous();
  const int64_t n = tok.numel();
  const int64_t* t = tok.data_ptr<int64_t>();
  at::Tensor out = at::empty({n, C}, tokens.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const uint8_t* base = blocks.data_ptr<uint8_t>();
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK_VALUE(t[r] >= 0 && t[r] < V, "block_embedding: token ", t[r], " outside the vocabulary of ", V);
    if (type != fms_gguf::kQ8_0 && type != fms_gguf::kQ4_0) {  // w = a u + b (a u exact; one fp32 rounding)
      const uint8_t* row = base + t[r] * blocks.size(1) * bb;
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t u[32];
        float a[2], off[2];
        fms_gguf::decode_sub(type, row, b, u, a, off);
        for (int i = 0; i < 32; ++i) o[r * C + b * 32 + i] = a[i / 16] * static_cast<float>(u[i]) + off[i / 16];
      }
      continue;
    }
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = base + (t[r] * nb + b) * bb;
      const float d = static_cast<float>(c10::Half(static_cast<uint16_t>(blk[0] | (blk[1] << 8)), c10::Half::from_bits()));
      float* dst = o + r * C + b * 32;
      if (type == 8)
        for (int i = 0; i < 32; ++i) dst[i] = d * static_cast<float>(static_cast<int8_t>(blk[2 + i]));
      else
        for (int i = 0; i < 16; ++i)
          dst[i] = d * static_cast<float>((blk[2 + i] & 0x0f) - 8), dst[i + 16] = d * static_cast<float>((blk[2 + i] >> 4) - 8);
    }
  }
  std::vector<int64_t> sizes(tokens.sizes().begin(), tokens.sizes().end());
  sizes.push_back(C);
  return (dtype == at::kFloat ? out : out.to(dtype)).view(sizes);
}

}  // namespace fms_paged_ops

TORCH_LIBRARY_FRAGMENT(fms_paged, m) {
  m.def("qlinear(Tensor x, Tensor[] weights, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(fms_paged, CPU, m) { m.impl("qlinear", &fms_paged_ops::qlinear); }
