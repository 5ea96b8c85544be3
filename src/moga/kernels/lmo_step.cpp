// One pass per row: momentum EMA (and Nesterov), the row's ||.||_p, decoupled weight decay and the
// update of W, for the row, col, sign and embedding geometries (GEOMETRY.md). Readable reference:
// reference.py beside this file; the two are tested equal.
//
// Every tensor is viewed as (B, K, N) and normalized along K for each (b, j):
//   N == 1 : "row mode", each of the B rows of length K is contiguous;
//   N  > 1 : "column mode", columns of stride N, worked on in blocks of columns so that a block's
//            K x width tile stays in cache between its two passes.
// Per row (or column) x, with d the direction (momentum EMA, Nesterov look-ahead or the gradient):
//   pass A: update m, compute d, t = sign(d)|d|^(p-1) into scratch, S = sum |d|^p, a = max |d|;
//   pass B: W <- decay * W + f * t, with f = c / S^((p-1)/p) (c = -lr * geometry factor).
// p == 1 is sign: a single pass. Rows whose sums would under- or overflow (the current path's
// "huge/tiny magnitudes") are redone in double, divided by their maximum first.
// Math is in float32 for float32 and bfloat16 parameters, float64 for float64.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <atomic>
#include <optional>
#include <vector>

#include <torch/library.h>

namespace {

using at::vec::Vectorized;

enum class Kind { Sign, P2, P15, P25, Generic };

struct Config {
  double p;         // exponent of phi_p
  double beta;      // momentum; 0 = none
  bool nesterov;
  double decay;     // 1 - lr * weight_decay
};

// torch.lerp's formula (so the EMA rounds like torch._foreach_lerp_): weight < 0.5 starts from x.
template <typename T>
inline Vectorized<T> lerp(const Vectorized<T>& x, const Vectorized<T>& y, T w) {
  if (w < T(0.5)) return at::vec::fmadd(Vectorized<T>(w), y - x, x);
  return y - (y - x) * Vectorized<T>(T(1) - w);
}

template <typename T>
inline T lerp(T x, T y, T w) {
  return w < T(0.5) ? x + w * (y - x) : y - (y - x) * (T(1) - w);
}

template <typename T>
inline Vectorized<T> with_sign_of(const Vectorized<T>& magnitude, const Vectorized<T>& d) {
  return magnitude | (d & Vectorized<T>(T(-0.0)));  // the sign bit of d on |d|^(p-1) >= 0
}

template <typename T>
inline Vectorized<T> sign_of(const Vectorized<T>& d) {
  const Vectorized<T> zero(T(0));
  return d.gt(zero) - d.lt(zero);  // torch.sign: 0 at 0
}

// The direction at one vector of elements: updates m in place when there is momentum.
template <typename T>
inline Vectorized<T> direction(const T* g, T* m, int64_t count, const Config& cfg) {
  using V = Vectorized<T>;
  V gv = V::loadu(g, count);
  if (m == nullptr) return gv;
  V mv = lerp(V::loadu(m, count), gv, T(1 - cfg.beta));
  mv.store(m, count);
  return cfg.nesterov ? lerp(gv, mv, T(cfg.beta)) : mv;
}

// The direction again (m already updated), for the rare rows redone in double.
template <typename T>
inline T direction_again(const T* g, const T* m, int64_t i, const Config& cfg) {
  if (m == nullptr) return g[i];
  return cfg.nesterov ? lerp(g[i], m[i], T(cfg.beta)) : m[i];
}

// t = sign(d)|d|^(p-1) for the fast kinds; accumulates |d|^p into s.
template <typename T, Kind K>
inline Vectorized<T> powered(const Vectorized<T>& d, Vectorized<T>& s) {
  using V = Vectorized<T>;
  if constexpr (K == Kind::P2) {
    s = at::vec::fmadd(d, d, s);
    return d;
  } else {
    V a = d.abs();
    V u = (K == Kind::P15) ? a.sqrt() : a * a.sqrt();  // |d|^0.5 or |d|^1.5
    s = at::vec::fmadd(a, u, s);
    return with_sign_of(u, d);
  }
}

template <typename T>
inline T horizontal_sum(const Vectorized<T>& v) {
  T lanes[Vectorized<T>::size()];
  v.store(lanes);
  T total = 0;
  for (int64_t k = 0; k < Vectorized<T>::size(); ++k) total += lanes[k];
  return total;
}

template <typename T>
inline T horizontal_max(const Vectorized<T>& v) {
  T lanes[Vectorized<T>::size()];
  v.store(lanes);
  T best = lanes[0];
  for (int64_t k = 1; k < Vectorized<T>::size(); ++k) best = (lanes[k] > best || std::isnan(lanes[k])) ? lanes[k] : best;
  return best;
}

// True when S = sum |d|^p and the maximum a can be used as they are in T: no term that matters
// underflowed and nothing overflowed (NaN also fails, and is then carried through in double).
template <typename T>
inline bool in_range(double s, double a, double p) {
  const double tiny = std::numeric_limits<T>::min(), huge = std::numeric_limits<T>::max();
  return s <= huge * 0x1p-24 && std::pow(a, p) >= tiny * 0x1p24;
}

// f = c / S^((p-1)/p); 0 for a zero row (its LMO is zero, never NaN).
inline double factor(double s, double p, double c, Kind kind) {
  if (!(s > 0)) return s == 0 ? 0.0 : s;  // 0 or NaN
  if (kind == Kind::P2) return c / std::sqrt(s);
  return c * std::pow(s, -(p - 1) / p);
}

// d for every element of a row or tile into out (m already updated).
template <typename T>
void redo_direction(const T* g, const T* m, int64_t rows, int64_t cols, int64_t stride, T* out, int64_t out_stride,
                    const Config& cfg) {
  for (int64_t k = 0; k < rows; ++k)
    for (int64_t j = 0; j < cols; ++j)
      out[k * out_stride + j] = direction_again(g + k * stride, m ? m + k * stride : nullptr, j, cfg);
}

// The slow, exact update of one row or column of directions d (stride apart) in double, divided by
// its maximum first so that neither |d|^p nor |d|^(p-1) under- or overflows.
template <typename T>
void exact_update(const T* d, T* w, int64_t n, int64_t d_stride, int64_t w_stride, const Config& cfg, double c) {
  double peak = 0;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    double a = std::abs(double(d[i * d_stride]));
    nan |= std::isnan(a);
    peak = std::max(peak, a);
  }
  const double p = cfg.p;
  const double inv = peak > 0 && std::isfinite(peak) ? 1.0 / peak : 1.0;
  double s = nan ? NAN : 0.0;
  for (int64_t i = 0; i < n; ++i) s += std::pow(std::abs(double(d[i * d_stride])) * inv, p);
  const double f = factor(s, p, c, Kind::Generic);
  for (int64_t i = 0; i < n; ++i) {
    double di = double(d[i * d_stride]);
    double t = std::copysign(std::pow(std::abs(di) * inv, p - 1), di);
    T& wi = w[i * w_stride];
    wi = T(double(T(wi * T(cfg.decay))) + f * t);
  }
}

template <typename T>
T* scratch(int64_t n) {
  thread_local std::vector<T> buffer;
  if (int64_t(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

// ---- row mode -----------------------------------------------------------------------------------

template <typename T, Kind K>
void row_step(const T* g, T* m, T* w, int64_t n, const Config& cfg, double c) {
  using V = Vectorized<T>;
  constexpr int64_t L = V::size();
  const V decay(T(cfg.decay));
  if constexpr (K == Kind::Sign) {
    const V cv = V(T(c));
    for (int64_t i = 0; i < n; i += L) {
      const int64_t cnt = std::min(L, n - i);
      V d = direction(g + i, m ? m + i : nullptr, cnt, cfg);
      at::vec::fmadd(cv, sign_of(d), V::loadu(w + i, cnt) * decay).store(w + i, cnt);
    }
    return;
  } else {
    T* t = scratch<T>(n);
    V s(T(0)), peak(T(0));
    for (int64_t i = 0; i < n; i += L) {
      const int64_t cnt = std::min(L, n - i);
      V d = direction(g + i, m ? m + i : nullptr, cnt, cfg);
      peak = at::vec::maximum(peak, d.abs());
      if constexpr (K == Kind::Generic) {
        d.store(t + i, cnt);
      } else {
        powered<T, K>(d, s).store(t + i, cnt);
      }
    }
    double total = horizontal_sum(s);
    if constexpr (K == Kind::Generic) {
      total = 0;
      for (int64_t i = 0; i < n; ++i) {
        T a = std::abs(t[i]);
        T u = std::pow(a, T(cfg.p - 1));
        total += double(a) * double(u);
        t[i] = std::copysign(u, t[i]);
      }
    }
    const double a = horizontal_max(peak);
    if (a == 0) {  // a zero row: only the decay
      for (int64_t i = 0; i < n; i += L) {
        const int64_t cnt = std::min(L, n - i);
        (V::loadu(w + i, cnt) * decay).store(w + i, cnt);
      }
      return;
    }
    if (!in_range<T>(total, a, cfg.p)) {
      redo_direction(g, m, 1, n, 0, t, 0, cfg);
      exact_update(t, w, n, 1, 1, cfg, c);
      return;
    }
    const V f(T(factor(total, cfg.p, c, K)));
    for (int64_t i = 0; i < n; i += L) {
      const int64_t cnt = std::min(L, n - i);
      at::vec::fmadd(f, V::loadu(t + i, cnt), V::loadu(w + i, cnt) * decay).store(w + i, cnt);
    }
  }
}

// ---- column mode: a block of `cols` columns, rows `stride` apart --------------------------------

template <typename T, Kind K>
void col_step(const T* g, T* m, T* w, int64_t rows, int64_t cols, int64_t stride, const Config& cfg, double c) {
  using V = Vectorized<T>;
  constexpr int64_t L = V::size();
  const V decay(T(cfg.decay));
  if constexpr (K == Kind::Sign) {
    for (int64_t k = 0; k < rows; ++k) row_step<T, K>(g + k * stride, m ? m + k * stride : nullptr, w + k * stride, cols, cfg, c);
    return;
  } else {
    const int64_t vecs = (cols + L - 1) / L, width = vecs * L;
    T* t = scratch<T>(rows * width);
    std::vector<V> s(vecs, V(T(0))), peak(vecs, V(T(0)));
    for (int64_t k = 0; k < rows; ++k) {
      for (int64_t v = 0; v < vecs; ++v) {
        const int64_t j = v * L, cnt = std::min(L, cols - j);
        V d = direction(g + k * stride + j, m ? m + k * stride + j : nullptr, cnt, cfg);
        peak[v] = at::vec::maximum(peak[v], d.abs());
        if constexpr (K == Kind::Generic) {
          d.store(t + k * width + j);
        } else {
          powered<T, K>(d, s[v]).store(t + k * width + j);
        }
      }
    }
    std::vector<T> total(width), top(width), f(width);
    for (int64_t v = 0; v < vecs; ++v) {
      s[v].store(total.data() + v * L);
      peak[v].store(top.data() + v * L);
    }
    if constexpr (K == Kind::Generic) {
      std::vector<double> acc(cols, 0.0);
      for (int64_t k = 0; k < rows; ++k) {
        T* tk = t + k * width;
        for (int64_t j = 0; j < cols; ++j) {
          T a = std::abs(tk[j]);
          T u = std::pow(a, T(cfg.p - 1));
          acc[j] += double(a) * double(u);
          tk[j] = std::copysign(u, tk[j]);
        }
      }
      for (int64_t j = 0; j < cols; ++j) total[j] = T(acc[j]);
    }
    bool exact = false;
    for (int64_t j = 0; j < cols; ++j) {
      if (top[j] != 0 && !in_range<T>(total[j], top[j], cfg.p)) exact = true;
      f[j] = top[j] == 0 ? T(0) : T(factor(total[j], cfg.p, c, K));
    }
    if (exact) {  // rare: the whole block in double, each column divided by its maximum
      redo_direction(g, m, rows, cols, stride, t, width, cfg);
      for (int64_t j = 0; j < cols; ++j) exact_update(t + j, w + j, rows, width, stride, cfg, c);
      return;
    }
    for (int64_t k = 0; k < rows; ++k) {
      for (int64_t v = 0; v < vecs; ++v) {
        const int64_t j = v * L, cnt = std::min(L, cols - j);
        T* wk = w + k * stride + j;
        at::vec::fmadd(V::loadu(f.data() + j), V::loadu(t + k * width + j), V::loadu(wk, cnt) * decay).store(wk, cnt);
      }
    }
  }
}

// ---- dispatch ------------------------------------------------------------------------------------

Kind kind_of(double p) {
  if (p == 1) return Kind::Sign;
  if (p == 2) return Kind::P2;
  if (p == 1.5) return Kind::P15;
  if (p == 2.5) return Kind::P25;
  return Kind::Generic;
}

// Columns per block: a K x width tile of scratch of about 128 KiB, whole cache lines, 16..256.
int64_t block_width(int64_t rows, int64_t elem_size) {
  int64_t w = (128 * 1024) / std::max<int64_t>(1, rows * elem_size);
  return std::clamp<int64_t>(w / 16 * 16, 16, 256);
}

// Storage S, math in T: float and double work in place; bfloat16 goes through float copies.
template <typename S, typename T, Kind K>
void tensor_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& buf, int64_t B, int64_t R, int64_t N,
                 const Config& cfg, double c) {
  S* w = param.data_ptr<S>();
  const S* g = grad.data_ptr<S>();
  S* m = buf.defined() ? buf.data_ptr<S>() : nullptr;
  if (N == 1) {  // rows of length R
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(R, 1));
    at::parallel_for(0, B, grain, [&](int64_t lo, int64_t hi) {
      for (int64_t b = lo; b < hi; ++b) {
        const int64_t off = b * R;
        if constexpr (std::is_same_v<S, T>) {
          row_step<T, K>(g + off, m ? m + off : nullptr, w + off, R, cfg, c);
        } else {
          thread_local std::vector<T> gf, mf, wf;
          gf.resize(R); mf.resize(R); wf.resize(R);
          for (int64_t i = 0; i < R; ++i) { gf[i] = T(g[off + i]); wf[i] = T(w[off + i]); if (m) mf[i] = T(m[off + i]); }
          row_step<T, K>(gf.data(), m ? mf.data() : nullptr, wf.data(), R, cfg, c);
          for (int64_t i = 0; i < R; ++i) { w[off + i] = S(wf[i]); if (m) m[off + i] = S(mf[i]); }
        }
      }
    });
    return;
  }
  const int64_t width = block_width(R, sizeof(T)), blocks = (N + width - 1) / width;
  at::parallel_for(0, B * blocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t b = item / blocks, j0 = (item % blocks) * width, cols = std::min(width, N - j0);
      const int64_t off = b * R * N + j0;
      if constexpr (std::is_same_v<S, T>) {
        col_step<T, K>(g + off, m ? m + off : nullptr, w + off, R, cols, N, cfg, c);
      } else {
        thread_local std::vector<T> gf, mf, wf;
        gf.resize(R * cols); mf.resize(R * cols); wf.resize(R * cols);
        for (int64_t k = 0; k < R; ++k)
          for (int64_t j = 0; j < cols; ++j) {
            const int64_t at = off + k * N + j, here = k * cols + j;
            gf[here] = T(g[at]); wf[here] = T(w[at]); if (m) mf[here] = T(m[at]);
          }
        col_step<T, K>(gf.data(), m ? mf.data() : nullptr, wf.data(), R, cols, cols, cfg, c);
        for (int64_t k = 0; k < R; ++k)
          for (int64_t j = 0; j < cols; ++j) {
            const int64_t at = off + k * N + j, here = k * cols + j;
            w[at] = S(wf[here]); if (m) m[at] = S(mf[here]);
          }
      }
    }
  });
}

template <typename S, typename T>
void tensor_step_any_p(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& buf, int64_t B, int64_t R,
                       int64_t N, const Config& cfg, double c) {
  switch (kind_of(cfg.p)) {
    case Kind::Sign: return tensor_step<S, T, Kind::Sign>(param, grad, buf, B, R, N, cfg, c);
    case Kind::P2: return tensor_step<S, T, Kind::P2>(param, grad, buf, B, R, N, cfg, c);
    case Kind::P15: return tensor_step<S, T, Kind::P15>(param, grad, buf, B, R, N, cfg, c);
    case Kind::P25: return tensor_step<S, T, Kind::P25>(param, grad, buf, B, R, N, cfg, c);
    default: return tensor_step<S, T, Kind::Generic>(param, grad, buf, B, R, N, cfg, c);
  }
}

bool flag_set(const std::optional<at::Tensor>& found_inf) {
  return found_inf.has_value() && found_inf->defined() && found_inf->item<double>() != 0;
}

}  // namespace

// params[k] += decay-and-LMO step; shapes holds (B, K, N) per tensor, scales the c = -lr * factor.
// Nothing is touched when found_inf holds a nonzero value (the optimizer's non-finite skip).
void lmo_step(at::TensorList params, at::TensorList grads, at::TensorList bufs, const std::optional<at::Tensor>& found_inf,
              at::IntArrayRef shapes, at::ArrayRef<double> scales, double p, double momentum, bool nesterov,
              double decay) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && scales.size() == n && shapes.size() == 3 * n, "moga lmo_step: list lengths differ");
  TORCH_CHECK(bufs.empty() || bufs.size() == n, "moga lmo_step: momentum buffers must be none or one per parameter");
  TORCH_CHECK(p >= 1 && std::isfinite(p), "moga lmo_step: p must be finite and >= 1, got ", p);
  if (flag_set(found_inf)) return;
  const Config cfg{p, bufs.empty() ? 0.0 : momentum, nesterov, decay};
  for (size_t k = 0; k < n; ++k) {
    const at::Tensor& w = params[k];
    const at::Tensor& g = grads[k];
    at::Tensor m = bufs.empty() ? at::Tensor() : bufs[k];
    const int64_t B = shapes[3 * k], R = shapes[3 * k + 1], N = shapes[3 * k + 2];
    TORCH_CHECK(w.device().is_cpu() && g.device().is_cpu(), "moga lmo_step: CPU tensors only");
    TORCH_CHECK(w.is_contiguous() && g.is_contiguous() && (!m.defined() || m.is_contiguous()),
                "moga lmo_step: tensors must be contiguous");
    TORCH_CHECK(g.scalar_type() == w.scalar_type() && (!m.defined() || m.scalar_type() == w.scalar_type()),
                "moga lmo_step: parameter, gradient and buffer dtypes differ");
    TORCH_CHECK(w.numel() == B * R * N && g.numel() == w.numel() && (!m.defined() || m.numel() == w.numel()),
                "moga lmo_step: shape (", B, ", ", R, ", ", N, ") does not match a tensor of ", w.numel(), " elements");
    if (w.numel() == 0) continue;
    switch (w.scalar_type()) {
      case at::kFloat: tensor_step_any_p<float, float>(w, g, m, B, R, N, cfg, scales[k]); break;
      case at::kDouble: tensor_step_any_p<double, double>(w, g, m, B, R, N, cfg, scales[k]); break;
      case at::kBFloat16: tensor_step_any_p<c10::BFloat16, float>(w, g, m, B, R, N, cfg, scales[k]); break;
      default: TORCH_CHECK(false, "moga lmo_step: float32, float64 or bfloat16 parameters, got ", w.scalar_type());
    }
  }
}

// 1.0 when any element of any tensor is NaN or inf, else 0.0: one read-only pass (x * 0 is 0 for
// every finite x and NaN otherwise, so a sum of them is exact, without overflow).
at::Tensor found_nonfinite(at::TensorList tensors) {
  bool bad = false;
  for (const at::Tensor& t0 : tensors) {
    if (bad) break;
    if (t0.numel() == 0) continue;
    at::Tensor t = t0.contiguous();
    TORCH_CHECK(t.device().is_cpu(), "moga found_nonfinite: CPU tensors only");
    const int64_t n = t.numel();
    std::atomic<bool> any{false};
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, t.scalar_type(), "found_nonfinite", [&] {
      const scalar_t* x = t.data_ptr<scalar_t>();
      at::parallel_for(0, n, 65536, [&](int64_t lo, int64_t hi) {
        if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>) {
          using V = Vectorized<scalar_t>;
          V acc(scalar_t(0));
          const V zero(scalar_t(0));
          int64_t i = lo;
          for (; i + V::size() <= hi; i += V::size()) acc = at::vec::fmadd(V::loadu(x + i), zero, acc);
          scalar_t rest = 0;
          for (; i < hi; ++i) rest += x[i] * scalar_t(0);
          if (std::isnan(horizontal_sum(acc) + rest)) any = true;
        } else {
          float acc = 0;
          for (int64_t i = lo; i < hi; ++i) acc += float(x[i]) * 0.0f;
          if (std::isnan(acc)) any = true;
        }
      });
    });
    bad = any.load();
  }
  return at::scalar_tensor(bad ? 1.0 : 0.0, at::kFloat);
}

// Plain ops of the compiled library; moga.kernels.ops wraps them in the public moga:: custom ops.
TORCH_LIBRARY(moga_kernels, m) {
  m.def("lmo_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] bufs, Tensor? found_inf, int[] shapes, "
        "float[] scales, float p, float momentum, bool nesterov, float decay) -> ()");
  m.def("found_nonfinite(Tensor[] tensors) -> Tensor");
}

TORCH_LIBRARY_IMPL(moga_kernels, CPU, m) {
  m.impl("lmo_step", &lmo_step);
  m.impl("found_nonfinite", &found_nonfinite);
}
