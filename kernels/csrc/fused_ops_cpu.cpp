// Fused elementwise operations of a Llama-family decoder layer, for CPU tensors (float32, bfloat16,
// float16 storage; float32 arithmetic):
//
//   rms_norm(out, x, weight, eps)            out = weight * round(x / sqrt(mean(x^2) + eps))
//   fused_add_rms_norm(x, residual, w, eps)  residual = round(x + residual); x = rms_norm(residual)
//   rotary_embedding(positions, q, k, cos_sin)  RoPE in place, rotate-half (GPT-NeoX) layout
//   silu_and_mul(out, x)                     out = silu(x[:, :I]) * x[:, I:]
//
// Each is one pass over memory where transformers' modules make three to six (casts, pow, mean,
// rsqrt, mul, cat, neg, add). Rounding to the storage type happens where those modules round (after
// the normalisation, after each RoPE product and sum, after SiLU), so a bfloat16 result matches theirs
// up to the order of the RMS sum. Every row is computed alone, in one fixed order: a row's result does
// not depend on the other rows of the batch (batch invariance). Rows are spread over torch's threads.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_vec.h"

namespace cbp {

namespace {

constexpr float LOG2E_F = 1.4426950408889634f;

template <typename T>
static inline float one(const T* p) {
  return Cvt<T>::one(*p);
}

// 1 / sqrt(mean(x^2) + eps) of one row of H elements (float32 sum, fixed order)
template <typename T>
static inline float inv_rms(const T* x, int64_t H, float eps) {
  vfloat acc = vfloat{};
  int64_t i = 0;
  for (; i + VL <= H; i += VL) {
    vfloat v = Cvt<T>::load(x + i);
    acc += v * v;
  }
  float s = hsum(acc);
  for (; i < H; ++i) {
    float v = one(x + i);
    s += v * v;
  }
  return 1.0f / std::sqrt(s / static_cast<float>(H) + eps);
}

// out = w * round(x * inv) for one row
template <typename T>
static inline void scale_row(T* out, const T* x, const T* w, int64_t H, float inv) {
  int64_t i = 0;
  const vfloat vi = vset1(inv);
  for (; i + VL <= H; i += VL) {
    vfloat n = Store<T>::rounded(Cvt<T>::load(x + i) * vi);
    Store<T>::vec(out + i, Cvt<T>::load(w + i) * n);
  }
  for (; i < H; ++i) out[i] = T(one(w + i) * Store<T>::round(one(x + i) * inv));
}

template <typename T>
void rms_norm_impl(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& w, float eps) {
  const int64_t T_ = x.size(0), H = x.size(1), xs = x.stride(0), os = out.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, T_, std::max<int64_t>(1, 16384 / H), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) scale_row<T>(op + t * os, xp + t * xs, wp, H, inv_rms<T>(xp + t * xs, H, eps));
  });
}

template <typename T>
void fused_add_rms_norm_impl(torch::Tensor& x, torch::Tensor& res, const torch::Tensor& w, float eps) {
  const int64_t T_ = x.size(0), H = x.size(1), xs = x.stride(0), rs = res.stride(0);
  T* xp = x.data_ptr<T>();
  T* rp = res.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  at::parallel_for(0, T_, std::max<int64_t>(1, 16384 / H), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      T* xr = xp + t * xs;
      T* rr = rp + t * rs;
      int64_t i = 0;
      for (; i + VL <= H; i += VL) Store<T>::vec(rr + i, Cvt<T>::load(xr + i) + Cvt<T>::load(rr + i));
      for (; i < H; ++i) rr[i] = T(one(xr + i) + one(rr + i));
      scale_row<T>(xr, rr, wp, H, inv_rms<T>(rr, H, eps));
    }
  });
}

// one head of D elements at p, rotated in place with the position's cos / sin rows (D / 2 each, storage T)
template <typename T>
static inline void rope_head(T* p, const T* cs, const T* sn, int64_t half) {
  int64_t i = 0;
  for (; i + VL <= half; i += VL) {
    vfloat x1 = Cvt<T>::load(p + i), x2 = Cvt<T>::load(p + half + i);
    vfloat c = Cvt<T>::load(cs + i), s = Cvt<T>::load(sn + i);
    vfloat a = Store<T>::rounded(x1 * c), b = Store<T>::rounded(x2 * s);
    vfloat d = Store<T>::rounded(x2 * c), e = Store<T>::rounded(x1 * s);
    Store<T>::vec(p + i, a - b);
    Store<T>::vec(p + half + i, d + e);
  }
  for (; i < half; ++i) {
    float x1 = one(p + i), x2 = one(p + half + i), c = one(cs + i), s = one(sn + i);
    float a = Store<T>::round(x1 * c), b = Store<T>::round(x2 * s);
    float d = Store<T>::round(x2 * c), e = Store<T>::round(x1 * s);
    p[i] = T(a - b);
    p[half + i] = T(d + e);
  }
}

template <typename T>
void rope_impl(const torch::Tensor& pos, torch::Tensor& q, torch::Tensor& k, const torch::Tensor& cos,
               const torch::Tensor& sin, int64_t D) {
  const int64_t T_ = q.size(0), hq = q.size(1) / D, hk = k.size(1) / D, half = D / 2;
  const int64_t qs = q.stride(0), ks = k.stride(0), cst = cos.stride(0), sst = sin.stride(0);
  const int64_t* pp = pos.data_ptr<int64_t>();
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const int64_t P = cos.size(0);
  for (int64_t t = 0; t < T_; ++t) TORCH_CHECK(pp[t] >= 0 && pp[t] < P, "position ", pp[t], " outside the RoPE table");
  at::parallel_for(0, T_, std::max<int64_t>(1, 8192 / ((hq + hk) * D)), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const T* c = cp + pp[t] * cst;
      const T* s = sp + pp[t] * sst;
      for (int64_t h = 0; h < hq; ++h) rope_head<T>(qp + t * qs + h * D, c, s, half);
      for (int64_t h = 0; h < hk; ++h) rope_head<T>(kp + t * ks + h * D, c, s, half);
    }
  });
}

// silu(g) = g * sigmoid(g), with sigmoid from e = 2^(-|g| log2 e) <= 1 (no overflow for any g)
static inline vfloat vsilu(vfloat g) {
  vfloat a = g < 0 ? -g : g;
  vfloat e = vexp2<7>(-a * LOG2E_F);
  vfloat one_ = vset1(1.0f);
  // the numerator is chosen before the one division (the two quotients of a vector select would be two
  // divisions, the slowest vector instruction here): the same values, bit for bit
  vfloat sig = (g < 0 ? e : one_) / (one_ + e);
  return g * sig;
}

static inline float silu1(float g) { return g / (1.0f + std::exp(-g)); }

template <typename T>
void silu_and_mul_impl(torch::Tensor& out, const torch::Tensor& x) {
  const int64_t T_ = x.size(0), I = x.size(1) / 2, xs = x.stride(0), os = out.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, T_, std::max<int64_t>(1, 16384 / I), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const T* g = xp + t * xs;
      const T* u = g + I;
      T* o = op + t * os;
      int64_t i = 0;
      for (; i + VL <= I; i += VL) Store<T>::vec(o + i, Store<T>::rounded(vsilu(Cvt<T>::load(g + i))) * Cvt<T>::load(u + i));
      for (; i < I; ++i) o[i] = T(Store<T>::round(silu1(one(g + i))) * one(u + i));
    }
  });
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

#define KRN_DISPATCH(dtype, FN, ...)                                                   \
  switch (dtype) {                                                                     \
    case at::kFloat: FN<float>(__VA_ARGS__); break;                                    \
    case at::kBFloat16: FN<at::BFloat16>(__VA_ARGS__); break;                          \
    case at::kHalf: FN<at::Half>(__VA_ARGS__); break;                                  \
    default: TORCH_CHECK(false, "unsupported dtype ", dtype);                          \
  }

}  // namespace

void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.dtype() == x.dtype() &&
              out.dtype() == x.dtype() && out.sizes() == x.sizes(), "rms_norm: shapes or dtypes differ");
  KRN_DISPATCH(x.scalar_type(), rms_norm_impl, out, x, weight, static_cast<float>(eps));
}

void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.dtype() == x.dtype() &&
              residual.dtype() == x.dtype() && residual.sizes() == x.sizes(),
              "fused_add_rms_norm: shapes or dtypes differ");
  KRN_DISPATCH(x.scalar_type(), fused_add_rms_norm_impl, x, residual, weight, static_cast<float>(eps));
}

void rotary_embedding(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                      torch::Tensor sin, int64_t head_dim) {
  check_rows(q, "q");
  check_rows(k, "k");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  TORCH_CHECK(positions.dtype() == at::kLong && positions.is_contiguous() && positions.numel() == q.size(0) &&
              k.size(0) == q.size(0), "rotary_embedding: positions must be int64 [num_tokens]");
  TORCH_CHECK(head_dim % 2 == 0 && q.size(1) % head_dim == 0 && k.size(1) % head_dim == 0 &&
              cos.size(1) == head_dim / 2 && sin.sizes() == cos.sizes(), "rotary_embedding: bad head_dim");
  TORCH_CHECK(k.dtype() == q.dtype() && cos.dtype() == q.dtype() && sin.dtype() == q.dtype(),
              "rotary_embedding: dtypes differ");
  KRN_DISPATCH(q.scalar_type(), rope_impl, positions, q, k, cos, sin, head_dim);
}

void silu_and_mul(torch::Tensor out, torch::Tensor x) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(x.size(1) % 2 == 0 && out.size(0) == x.size(0) && out.size(1) == x.size(1) / 2 &&
              out.dtype() == x.dtype(), "silu_and_mul: out must be [num_tokens, x.size(1) / 2] of x's dtype");
  KRN_DISPATCH(x.scalar_type(), silu_and_mul_impl, out, x);
}

void register_fused_ops(pybind11::module& m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (CPU)", py::call_guard<py::gil_scoped_release>());
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; x = RMSNorm(residual), in place (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rotary_embedding", &rotary_embedding, "RoPE in place, rotate-half layout (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up (CPU)", py::call_guard<py::gil_scoped_release>());
}

}  // namespace cbp
