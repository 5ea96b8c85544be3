// One pass per row: momentum EMA (and Nesterov), the row's ||.||_p, decoupled weight decay and the
// update of W, for the row, col, sign and embedding geometries (docs/math.md §2, the step §3.1).
// Readable reference: reference.py beside this file; the two are tested equal.
//
// Tensors are stepped last to first: the non-finite check has just read every gradient first to last,
// so the last ones are still in the last-level cache. (Rows stay in order: stepping them backwards
// defeats the hardware prefetcher and measured ~1.5x slower.)
//
// Every tensor is viewed as (B, K, N) and normalized along K for each (b, j):
//   N == 1 : "row mode", each of the B rows of length K is contiguous;
//   N  > 1 : "column mode", columns of stride N, normalized with two row-major sweeps (below).
// Per row (or column) x, with d the direction (momentum EMA, Nesterov look-ahead or the gradient):
//   pass A: update m, compute d, t = sign(d)|d|^(p-1) into scratch, S = sum |d|^p
//           (for p = 2 t = d, which pass B makes again from g and the new m for float storage: no scratch);
//           a = max |d| (rows: only where S alone cannot rule out a zero or out-of-range row, sure_in_range);
//   pass B: W <- decay * W + f * t, with f = c / S^((p-1)/p) (c = -lr * geometry factor).
// The passes at one vector of elements are written once (pass_a, t_again, pass_b); rows, columns, sign
// and the split shards' two ops differ only in how they loop over them.
// Rows run the passes software-pipelined, pass B of a row in the loop of the next row's pass A, every
// stream prefetched ahead (pipelined_rows): each pass alone keeps too few lines in flight for one core's
// bandwidth.
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
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <atomic>
#include <optional>
#include <type_traits>
#include <vector>

#include <torch/library.h>

namespace {

using at::vec::Vectorized;

// The per-vector helpers must inline into their loops: GCC kept direction() out of line, a call per
// vector that returned through memory (a quarter of the row step's time in perf).
#if defined(__GNUC__) || defined(__clang__)
#define MOGA_INLINE inline __attribute__((always_inline))
#define MOGA_INLINE_LAMBDA __attribute__((always_inline))
#define MOGA_NOINLINE __attribute__((noinline))
#else
#define MOGA_INLINE inline
#define MOGA_INLINE_LAMBDA
#define MOGA_NOINLINE
#endif

enum class Kind { Sign, P2, P15, P25, Generic };

struct Config {
  double p;         // exponent of phi_p
  double beta;      // momentum; 0 = none
  bool nesterov;
  double decay;     // 1 - lr * weight_decay
};

// torch.lerp's formula (so the EMA rounds like torch._foreach_lerp_): weight < 0.5 starts from x.
template <typename T>
MOGA_INLINE Vectorized<T> lerp(const Vectorized<T>& x, const Vectorized<T>& y, T w) {
  if (w < T(0.5)) return at::vec::fmadd(Vectorized<T>(w), y - x, x);
  return y - (y - x) * Vectorized<T>(T(1) - w);
}

template <typename T>
inline T lerp(T x, T y, T w) {
  return w < T(0.5) ? x + w * (y - x) : y - (y - x) * (T(1) - w);
}

template <typename T>
MOGA_INLINE Vectorized<T> with_sign_of(const Vectorized<T>& magnitude, const Vectorized<T>& d) {
  return magnitude | (d & Vectorized<T>(T(-0.0)));  // the sign bit of d on |d|^(p-1) >= 0
}

template <typename T>
MOGA_INLINE Vectorized<T> sign_of(const Vectorized<T>& d) {
  const Vectorized<T> zero(T(0));
  return d.gt(zero) - d.lt(zero);  // torch.sign: 0 at 0
}

// The direction's loop-invariant numbers in T, made once per row and passed by value: the vector
// stores may alias anything (the intrinsics' may_alias types), so numbers read through a Config& were
// reloaded, converted from double and broadcast for every vector (seen in perf annotate).
template <typename T>
struct Ema {
  T rate, beta;  // 1 - momentum, momentum
  bool nesterov;
  explicit Ema(const Config& cfg) : rate(T(1 - cfg.beta)), beta(T(cfg.beta)), nesterov(cfg.nesterov) {}
};

// The direction, its one form: from g and the updated momentum m, Nesterov's look-ahead lerp(g, m, beta)
// or m itself; g without momentum (m == nullptr). X is a vector or a scalar; g is read (load_g) only
// where it is used, so a caller may leave it unconverted otherwise.
template <typename X, typename T, typename LoadG>
MOGA_INLINE X direction_of(LoadG load_g, const X* m, const Ema<T>& ema) {
  if (m == nullptr) return load_g();
  return ema.nesterov ? lerp(load_g(), *m, ema.beta) : *m;
}

// ---- storage S, math T ----------------------------------------------------------------------------
// Every vector is read with load_as and written with store_as: the tensor's own memory when S == T; for
// bfloat16 storage (float math) converted in registers, a vector at a time, so a bfloat16 row makes the
// same passes as a float one. (Staging whole rows through float copies, as before, made the bfloat16 row
// step take ~1.7x as long: docs/results.md, Benchmarks.)

// bfloat16 <-> float for count (<= a float vector's size) elements, bit for bit as c10::BFloat16 converts:
// widening is exact; narrowing rounds to nearest even and stores NaN as 0x7FC0 (at::vec's own conversion
// stores 0xFFFF). Intrinsics: GCC vectorizes neither conversion well a vector at a time (it assembles
// the loads word by word and stores the results one by one).
MOGA_INLINE Vectorized<float> widen(const c10::BFloat16* src, int64_t count) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m256i h = count == 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))
                                : _mm256_maskz_loadu_epi16(__mmask16((1u << count) - 1), src);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#elif defined(CPU_CAPABILITY_AVX2)
  __m128i h;
  if (count == 8) {
    h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  } else {
    alignas(16) c10::BFloat16 part[8] = {};
    std::copy(src, src + count, part);
    h = _mm_load_si128(reinterpret_cast<const __m128i*>(part));
  }
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
  float lanes[Vectorized<float>::size()];
  for (int64_t k = 0; k < Vectorized<float>::size(); ++k) lanes[k] = k < count ? float(src[k]) : 0.0f;
  return Vectorized<float>::loadu(lanes);
#endif
}

MOGA_INLINE void narrow(const Vectorized<float>& v, c10::BFloat16* dst, int64_t count) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
  const __m256i h = _mm512_cvtepi32_epi16(r);
  if (count == 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), h);
  else _mm256_mask_storeu_epi16(dst, __mmask16((1u << count) - 1), h);
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i u = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // 32 -> 16 bits: packus works within 128-bit lanes (no saturation: r <= 0xFFFF), then quadwords 0 and 2
  const __m128i h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0b1000));
  if (count == 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), h);
  } else {
    alignas(16) c10::BFloat16 part[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(part), h);
    std::copy(part, part + count, dst);
  }
#else
  float lanes[Vectorized<float>::size()];
  v.store(lanes);
  for (int64_t k = 0; k < count; ++k) dst[k] = c10::BFloat16(lanes[k]);
#endif
}

// count elements of S as a vector of T, the lanes past count 0.
template <typename T, typename S>
MOGA_INLINE Vectorized<T> load_as(const S* src, int64_t count) {
  if constexpr (std::is_same_v<S, T>) return Vectorized<T>::loadu(src, count);
  else return widen(src, count);
}

// The first count lanes of v into S.
template <typename T, typename S>
MOGA_INLINE void store_as(const Vectorized<T>& v, S* dst, int64_t count) {
  if constexpr (std::is_same_v<S, T>) v.store(dst, count);
  else narrow(v, dst, count);
}

// The direction at one vector of elements, after the EMA update of m in place (when there is momentum);
// kept, when given, receives the updated m in T too (a bfloat16 m is rounded where it is stored).
template <typename S, typename T>
MOGA_INLINE Vectorized<T> direction(const S* g, S* m, int64_t count, const Ema<T> ema, T* kept = nullptr) {
  using V = Vectorized<T>;
  V gv = load_as<T>(g, count);
  if (m == nullptr) return gv;
  V mv = lerp(load_as<T>(m, count), gv, ema.rate);
  store_as(mv, m, count);
  if (kept != nullptr) mv.store(kept, count);
  return direction_of([&] { return gv; }, &mv, ema);
}

// The direction at one vector of elements, m already updated (the second sweep over a row or column).
template <typename S, typename T>
MOGA_INLINE Vectorized<T> direction_peek(const S* g, const S* m, int64_t count, const Ema<T> ema) {
  using V = Vectorized<T>;
  if (m == nullptr) return load_as<T>(g, count);
  const V mv = load_as<T>(m, count);
  return direction_of([&] { return load_as<T>(g, count); }, &mv, ema);
}

// The direction at element i, m already updated: for the rare rows and columns redone in double.
template <typename T, typename G, typename M>
inline T direction_at(const G* g, const M* m, int64_t i, const Ema<T>& ema) {
  const T mi = m ? T(m[i]) : T(0);
  return direction_of([&] { return T(g[i]); }, m ? &mi : nullptr, ema);
}

// t = sign(d)|d|^(p-1); accumulates |d|^p into s. p = 1.5, 2, 2.5 avoid pow (Sleef's, ~10x slower).
template <typename T, Kind K>
MOGA_INLINE Vectorized<T> powered(const Vectorized<T>& d, Vectorized<T>& s, const Vectorized<T>& p_minus_1) {
  using V = Vectorized<T>;
  if constexpr (K == Kind::P2) {
    s = at::vec::fmadd(d, d, s);
    return d;
  } else {
    V a = d.abs();
    V u;
    if constexpr (K == Kind::P15) u = a.sqrt();
    else if constexpr (K == Kind::P25) u = a * a.sqrt();
    else u = a.pow(p_minus_1);
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
  return s <= huge * 0x1p-24 && (p == 2 ? a * a : std::pow(a, p)) >= tiny * 0x1p24;
}

// True when S alone shows that in_range holds and the row is not zero, whatever its maximum a: S is at
// most n (1 + n eps)(1 + 3 eps) a^p, terms and sum rounded in T (a term's underflow adds at most tiny eps),
// so S >= 4 n tiny 2^24 gives a^p >= tiny 2^24 for n eps <= 1/4.
template <typename T>
inline bool sure_in_range(double s, int64_t n) {
  const double tiny = std::numeric_limits<T>::min(), huge = std::numeric_limits<T>::max();
  return n <= (int64_t(1) << 22) && s >= 4.0 * double(n) * tiny * 0x1p24 && s <= huge * 0x1p-24;
}

// f = c / S^((p-1)/p); 0 for a zero row (its LMO is zero, never NaN).
inline double factor(double s, double p, double c, Kind kind) {
  if (!(s > 0)) return s == 0 ? 0.0 : s;  // 0 or NaN
  if (kind == Kind::P2) return c / std::sqrt(s);
  return c * std::pow(s, -(p - 1) / p);
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
  // |d| / peak; by the reciprocal where it is finite, else (a float64 row of subnormals) by division
  const double inv = peak > 0 && std::isfinite(peak) ? 1.0 / peak : 1.0;
  const double divisor = std::isfinite(inv) ? 1.0 : peak;
  const double by = std::isfinite(inv) ? inv : 1.0;
  double s = nan ? NAN : 0.0;
  for (int64_t i = 0; i < n; ++i) s += std::pow(std::abs(double(d[i * d_stride])) * by / divisor, p);
  const double f = factor(s, p, c, Kind::Generic);
  for (int64_t i = 0; i < n; ++i) {
    double di = double(d[i * d_stride]);
    double t = std::copysign(std::pow(std::abs(di) * by / divisor, p - 1), di);
    T& wi = w[i * w_stride];
    wi = T(double(T(wi * T(cfg.decay))) + f * t);
  }
}

// Hints to fetch the cache line at p for reading (RW = 0) or writing (RW = 1); no-ops where the compiler has no
// such builtin.
template <int RW>
inline void prefetch(const void* p) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, RW, 3);
#else
  (void)p;
#endif
}

inline void prefetch_for_read(const void* p) { prefetch<0>(p); }
inline void prefetch_for_write(const void* p) { prefetch<1>(p); }

// Each stream is prefetched this many elements ahead (pipelined rows, sign rows, column sweeps): the
// hardware prefetcher alone keeps too few lines in flight for one core's bandwidth.
constexpr int64_t kPipelineAhead = 768;

// The line kPipelineAhead elements past p, which may lie past the tensor's end: the address is formed as an
// integer, since a pointer past an array's end is undefined behaviour in C++ (a prefetch itself never faults).
template <typename S>
inline const void* ahead(const S* p) {
  return reinterpret_cast<const void*>(reinterpret_cast<std::uintptr_t>(p) + uintptr_t(kPipelineAhead * sizeof(S)));
}

// d at one vector of elements made again, bit for bit as pass A made it: from g and the updated m as
// computed, in T (a bfloat16 m's unrounded copy; none without momentum).
template <typename S, typename T>
MOGA_INLINE Vectorized<T> direction_again(const S* g, const T* m, int64_t count, const Ema<T> ema) {
  using V = Vectorized<T>;
  const V mv = m ? V::loadu(m, count) : V(T(0));
  return direction_of([&] { return load_as<T>(g, count); }, m ? &mv : nullptr, ema);
}

// ---- the two passes of a row (or of a row of columns), at one vector of elements ------------------
// The one row step: the pipelined rows, the split shards' sums and update, the column sweeps and sign
// all call these (what differs between them is where t comes from and what they track besides).

// Pass A: updates m (kept, when given, receives its new value in T), adds |d|^p to s, raises peak (when
// given) to max |d|, and returns t = sign(d)|d|^(p-1).
template <typename S, typename T, Kind K>
MOGA_INLINE Vectorized<T> pass_a(const S* g, S* m, int64_t count, const Ema<T> ema, const Vectorized<T>& e,
                                 Vectorized<T>& s, T* kept = nullptr, Vectorized<T>* peak = nullptr) {
  const Vectorized<T> d = direction(g, m, count, ema, kept);
  if (peak != nullptr) *peak = at::vec::maximum(*peak, d.abs());
  return powered<T, K>(d, s, e);
}

// t made again from g and the updated m (as pass A made it where m is stored in T), for a pass B that
// kept no t.
template <typename S, typename T, Kind K>
MOGA_INLINE Vectorized<T> t_again(const S* g, const S* m, int64_t count, const Ema<T> ema, const Vectorized<T>& e) {
  Vectorized<T> unused(T(0));
  return powered<T, K>(direction_peek(g, m, count, ema), unused, e);
}

// Pass B: W <- decay W + f t.
template <typename S, typename T>
MOGA_INLINE void pass_b(S* w, const Vectorized<T>& t, const Vectorized<T>& f, const Vectorized<T>& decay,
                        int64_t count) {
  store_as(at::vec::fmadd(f, t, load_as<T>(w, count) * decay), w, count);
}

// max |d| over a row, d made again as pass A made it; NaN if any is NaN.
template <typename S, typename T>
MOGA_NOINLINE T row_peak(const S* g, const T* m, int64_t n, const Ema<T>& ema) {
  using V = Vectorized<T>;
  constexpr int64_t L = V::size();
  V peak(T(0));
  for (int64_t i = 0; i < n; i += L) {
    const int64_t cnt = std::min(L, n - i);
    peak = at::vec::maximum(peak, direction_again(g + i, m ? m + i : nullptr, cnt, ema).abs());
  }
  return horizontal_max(peak);
}

// A thread-local row of n elements of T, one per slot.
template <typename T>
T* scratch(int64_t n, int slot) {
  thread_local std::vector<T> buffers[4];
  if (int64_t(buffers[slot].size()) < n) buffers[slot].resize(n);
  return buffers[slot].data();
}

// Rows of length R per parallel task: about 32k elements each.
inline int64_t row_grain(int64_t R) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(R, 1)); }

// ---- row mode -----------------------------------------------------------------------------------

// The rare row whose sums are out of range, redone in double from d (g and the updated m, in T); W of
// bfloat16 through a float copy in spare (which may hold m: d is made first). Out of line: inlined, its
// loops made the row step 1.7x as long.
template <typename S, typename T>
MOGA_NOINLINE void exact_row(const S* g, const T* m, S* w, int64_t n, const Ema<T>& ema, const Config& cfg, double c,
                             T* d, T* spare) {
  for (int64_t i = 0; i < n; ++i) d[i] = direction_at(g, m, i, ema);
  if constexpr (std::is_same_v<S, T>) {
    exact_update(d, w, n, 1, 1, cfg, c);
  } else {
    for (int64_t i = 0; i < n; ++i) spare[i] = T(w[i]);
    exact_update(d, spare, n, 1, 1, cfg, c);
    for (int64_t i = 0; i < n; ++i) w[i] = S(spare[i]);
  }
}

// Rows of sign: one pass, every stream prefetched ahead.
template <typename S, typename T>
void sign_rows(const S* g, S* m, S* w, int64_t rows, int64_t n, const Config& cfg, double c) {
  using V = Vectorized<T>;
  constexpr int64_t L = V::size();
  const V decay(T(cfg.decay));
  const V cv = V(T(c));
  const Ema<T> ema(cfg);
  for (int64_t i = 0; i < rows * n; i += L) {  // rows are contiguous: one sweep
    const int64_t cnt = std::min(L, rows * n - i);
    prefetch_for_read(ahead(g + i));
    if (m) prefetch_for_write(ahead(m + i));
    prefetch_for_write(ahead(w + i));
    pass_b(w + i, sign_of(direction(g + i, m ? m + i : nullptr, cnt, ema)), cv, decay, cnt);
  }
}

// Rows of p > 1, software-pipelined: one loop makes pass A of row r (m, S and t) beside pass B of row
// r - 1 (W), so that g, m and W stream from memory together, as in fused AdamW's single pass, and only row
// r - 1's t must stay in cache between its passes. Each stream is prefetched kPipelineAhead elements ahead.
// Against two passes per row, each prefetching the other's streams a row ahead (which kept up to four
// rows' lines in L1: 48 KiB for rows of 3072), this measured 4-7% faster for float32 rows of p = 2 and
// 12-16% for p = 1.5 and for bfloat16 (without the prefetches, 5% slower: docs/results.md, Benchmarks).
// Bit for bit the same results: each row's sums and updates are made as before.

template <typename S, typename T, Kind K>
void pipelined_rows(const S* g, S* m, S* w, int64_t rows, int64_t n, const Config& cfg, double c) {
  using V = Vectorized<T>;
  constexpr int64_t L = V::size();
  // t = sign(d)|d|^(p-1) from pass A to pass B, one scratch row for each of the two rows in flight. Not
  // for p = 2 with float storage: there t = d, which pass B makes again from m (or g, or both for
  // Nesterov), still in cache. bfloat16 storage rounds m where it is stored, so there t keeps d (making it
  // again from g and m's float copy measured ~15% slower with Nesterov).
  constexpr bool keeps_t = K != Kind::P2 || !std::is_same_v<S, T>;
  T* const t_rows[2] = {keeps_t ? scratch<T>(n, 0) : nullptr, keeps_t ? scratch<T>(n, 1) : nullptr};
  // The rare second look at a row's d makes it from g and the updated m as computed: a bfloat16 m's float
  // copy (m_kept, row r's), or for p = 2 d itself in t, read as an m without Nesterov.
  T* const m_kept = std::is_same_v<S, T> || m == nullptr || K == Kind::P2 ? nullptr : scratch<T>(n, 2);
  const V decay(T(cfg.decay));
  const Ema<T> ema(cfg);
  const V e = V(T(cfg.p - 1));
  // pass A of row r at element i: updates m, adds |d|^p to s, keeps t
  auto a_at = [&](int64_t r, int64_t i, int64_t cnt, V& s) MOGA_INLINE_LAMBDA {
    const int64_t off = r * n + i;
    const V t = pass_a<S, T, K>(g + off, m ? m + off : nullptr, cnt, ema, e, s, m_kept ? m_kept + i : nullptr);
    if constexpr (keeps_t) t.store(t_rows[r & 1] + i, cnt);
  };
  // pass B of row r at element i: W <- decay W + f t (t from its source: a choice per vector, invariant
  // in the loop; one loop per source measured 3-5% slower)
  auto b_at = [&](int64_t r, int64_t i, int64_t cnt, const V& f) MOGA_INLINE_LAMBDA {
    const int64_t off = r * n + i;
    V t;
    if constexpr (keeps_t) t = V::loadu(t_rows[r & 1] + i, cnt);
    else t = t_again<S, T, K>(g + off, m ? m + off : nullptr, cnt, ema, e);
    pass_b(w + off, t, f, decay, cnt);
  };
  // The rare row whose sum alone cannot rule out a zero row or an out-of-range one: the maximum |d|, taken in
  // a second look at the row (tracking it in pass A cost 5-8% of the step), tells. Returns whether it
  // stepped the row (a zero row: only the decay; out of range: exactly, in double).
  auto stepped_rare = [&](int64_t r, double total) -> bool {
    const int64_t off = r * n;
    const T* m_new = m_kept;
    Ema<T> again = ema;
    if constexpr (std::is_same_v<S, T>) {
      m_new = m ? m + off : nullptr;
    } else if constexpr (K == Kind::P2) {
      m_new = t_rows[r & 1];
      again.nesterov = false;
    }
    const double a = row_peak(g + off, m_new, n, again);
    if (a == 0) {
      for (int64_t i = 0; i < n; i += L) {
        const int64_t cnt = std::min(L, n - i);
        store_as(load_as<T>(w + off + i, cnt) * decay, w + off + i, cnt);
      }
      return true;
    }
    if (in_range<T>(total, a, cfg.p)) return false;
    // d into row r's t (t[i] from m_new[i] only)
    exact_row(g + off, m_new, w + off, n, again, cfg, c, keeps_t ? t_rows[r & 1] : scratch<T>(n, 0), scratch<T>(n, 3));
    return true;
  };
  // Row r's factor f = c / S^((p-1)/p), or none where the rare path stepped the row.
  auto factor_of = [&](int64_t r, double total) -> std::optional<T> {
    if (!sure_in_range<T>(total, n) && stepped_rare(r, total)) return std::nullopt;
    return T(factor(total, cfg.p, c, K));
  };
  std::optional<T> pending;  // the factor of row r - 1, whose pass B is still to run
  for (int64_t r = 0; r < rows; ++r) {
    V s(T(0));
    if (pending) {
      const V f(*pending);
      for (int64_t i = 0; i < n; i += L) {
        const int64_t cnt = std::min(L, n - i), off = r * n + i;
        prefetch_for_read(ahead(g + off));
        if (m) prefetch_for_write(ahead(m + off));
        prefetch_for_write(ahead(w + off - n));
        a_at(r, i, cnt, s);
        b_at(r - 1, i, cnt, f);
      }
    } else {
      for (int64_t i = 0; i < n; i += L) a_at(r, i, std::min(L, n - i), s);
    }
    pending = factor_of(r, horizontal_sum(s));
  }
  if (pending) {
    const V f(*pending);
    for (int64_t i = 0; i < n; i += L) b_at(rows - 1, i, std::min(L, n - i), f);
  }
}

// ---- column mode ---------------------------------------------------------------------------------
// Columns of a row-major (R, N) slice are normalized with two row-major sweeps, so that every access is
// sequential: sweep A updates m and sums |d|^p per column, sweep B takes d from the new m
// (and g, for Nesterov or without momentum) and updates W: 6 streams, 7 with g (fused AdamW's count). A
// column-blocked single pass with its strided rows measured 2-3x slower, and sweeping two chunks at once
// per thread (four read streams in flight) no faster. Rows are split into fixed chunks with their own
// partial sums, added in a fixed order, so the result does not depend on the number of threads.

constexpr int64_t kChunkRows = 32;

// Sweep A over rows of length N (a chunk) into the chunk's partial sums s (and maxima top, Tracked). A
// function of its own, its numbers passed by value: read through the parallel region's captures, they were
// reloaded at every vector (the vector stores may alias anything).
template <typename S, typename T, Kind K, bool Tracked>
MOGA_NOINLINE void col_chunk_a(const S* g, S* m, int64_t rows, int64_t N, const Ema<T> ema, const Vectorized<T> e, T* s,
                               T* top) {
  using V = Vectorized<T>;
  constexpr int64_t L = V::size();
  for (int64_t off = 0; off < rows * N; off += N) {
    for (int64_t j = 0; j < N; j += L) {
      const int64_t cnt = std::min(L, N - j);
      prefetch_for_read(ahead(g + off + j));
      if (m) prefetch_for_write(ahead(m + off + j));
      V sv = V::loadu(s + j);
      if constexpr (Tracked) {
        V peak = V::loadu(top + j);
        pass_a<S, T, K>(g + off + j, m ? m + off + j : nullptr, cnt, ema, e, sv, nullptr, &peak);
        peak.store(top + j);
      } else {
        pass_a<S, T, K>(g + off + j, m ? m + off + j : nullptr, cnt, ema, e, sv);
      }
      sv.store(s + j);
    }
  }
}

// Sweep A: updates m and writes each column's S = sum |d|^p and, where tops_out is given, a = max |d| to
// sums and tops, row b of the slices at b * stride (stride >= N; the entries past N are left as they are).
// Without tops_out no maximum is tracked (the step needs it only for columns that sure_in_range does not
// clear: col_tops makes it then); g and m are prefetched ahead.
template <typename S, typename T, Kind K>
void col_sums(const S* g, S* m, int64_t B, int64_t R, int64_t N, const Config& cfg, T* sums_out, T* tops_out,
              int64_t stride) {
  using V = Vectorized<T>;
  constexpr int64_t L = V::size();
  const int64_t chunks = std::max<int64_t>(1, (R + kChunkRows - 1) / kChunkRows), width = (N + L - 1) / L * L;
  const bool track = tops_out != nullptr;
  std::vector<T> sums(B * chunks * width), tops(track ? B * chunks * width : 0);  // R = 0 (an empty shard): zeros
  const V e = V(T(cfg.p - 1));
  const Ema<T> ema(cfg);
  auto sweep = [&](auto tracked) MOGA_INLINE_LAMBDA {
    at::parallel_for(0, B * chunks, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t item = lo; item < hi; ++item) {
        const int64_t b = item / chunks, k0 = (item % chunks) * kChunkRows, k1 = std::min(R, k0 + kChunkRows);
        const int64_t off = (b * R + k0) * N;
        col_chunk_a<S, T, K, decltype(tracked)::value>(g + off, m ? m + off : nullptr, k1 - k0, N, ema, e,
                                                         sums.data() + item * width,
                                                         decltype(tracked)::value ? tops.data() + item * width : nullptr);
      }
    });
  };
  if (track) sweep(std::true_type());
  else sweep(std::false_type());
  for (int64_t b = 0; b < B; ++b) {  // the chunks' partial sums, in order
    T* s0 = sums.data() + b * chunks * width;
    T* t0 = track ? tops.data() + b * chunks * width : nullptr;
    for (int64_t ch = 1; ch < chunks; ++ch) {
      const T* s1 = s0 + ch * width;
      for (int64_t j = 0; j < width; j += L) (V::loadu(s0 + j) + V::loadu(s1 + j)).store(s0 + j);
      if (track)
        for (int64_t j = 0; j < width; j += L)
          at::vec::maximum(V::loadu(t0 + j), V::loadu(t0 + ch * width + j)).store(t0 + j);
    }
    std::copy(s0, s0 + N, sums_out + b * stride);
    if (track) std::copy(t0, t0 + N, tops_out + b * stride);
  }
}

// max |d| per column of slice b into tops (N entries), d made again from g and the updated m (float storage:
// as sweep A made it); for the rare slice with a column that sure_in_range does not clear.
template <typename S, typename T>
MOGA_NOINLINE void col_tops(const S* g, const S* m, int64_t b, int64_t R, int64_t N, const Config& cfg, T* tops) {
  using V = Vectorized<T>;
  constexpr int64_t L = V::size();
  const Ema<T> ema(cfg);
  std::fill(tops, tops + N, T(0));
  for (int64_t k = 0; k < R; ++k) {
    const int64_t off = (b * R + k) * N;
    for (int64_t j = 0; j < N; j += L) {
      const int64_t cnt = std::min(L, N - j);
      const V d = direction_peek(g + off + j, m ? m + off + j : nullptr, cnt, ema);
      at::vec::maximum(V::loadu(tops + j, cnt), d.abs()).store(tops + j, cnt);
    }
  }
}

// Sweep B over rows of length N (a chunk): W <- decay * W + f t, f per column (by value: as col_chunk_a).
template <typename S, typename T, Kind K>
MOGA_NOINLINE void col_chunk_b(const S* g, const S* m, S* w, int64_t rows, int64_t N, const Ema<T> ema,
                               const Vectorized<T> e, const Vectorized<T> decay, const T* f) {
  using V = Vectorized<T>;
  constexpr int64_t L = V::size();
  for (int64_t off = 0; off < rows * N; off += N) {
    for (int64_t j = 0; j < N; j += L) {
      const int64_t cnt = std::min(L, N - j);
      prefetch_for_read(ahead(m && !ema.nesterov ? m + off + j : g + off + j));
      if (m && ema.nesterov) prefetch_for_read(ahead(m + off + j));
      prefetch_for_write(ahead(w + off + j));
      const V t = t_again<S, T, K>(g + off + j, m ? m + off + j : nullptr, cnt, ema, e);
      pass_b(w + off + j, t, V::loadu(f + j, cnt), decay, cnt);
    }
  }
}

// Sweep B: W <- decay * W + f t for every column, f (row b at b * stride) from the column's sums; the
// slices whose skip flag is set are left untouched.
template <typename S, typename T, Kind K>
void col_update(const S* g, const S* m, S* w, int64_t B, int64_t R, int64_t N, const Config& cfg, const T* f,
                int64_t stride, const char* skip) {
  using V = Vectorized<T>;
  const int64_t chunks = (R + kChunkRows - 1) / kChunkRows;
  const V e = V(T(cfg.p - 1)), decay(T(cfg.decay));
  const Ema<T> ema(cfg);
  at::parallel_for(0, B * chunks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t b = item / chunks, k0 = (item % chunks) * kChunkRows, k1 = std::min(R, k0 + kChunkRows);
      if (skip[b]) continue;
      const int64_t off = (b * R + k0) * N;
      col_chunk_b<S, T, K>(g + off, m ? m + off : nullptr, w + off, k1 - k0, N, ema, e, decay, f + b * stride);
    }
  });
}

// The exact update of column j of slice b in double (d from g and the updated m).
template <typename S, typename T>
void col_exact(const S* g, const S* m, S* w, int64_t b, int64_t j, int64_t R, int64_t N, const Config& cfg,
               double c) {
  std::vector<T> d(R), wcol(R);
  const Ema<T> ema(cfg);
  for (int64_t k = 0; k < R; ++k) {
    const int64_t at = (b * R + k) * N + j;
    d[k] = direction_at(g, m, at, ema);
    wcol[k] = T(w[at]);
  }
  exact_update(d.data(), wcol.data(), R, 1, 1, cfg, c);
  for (int64_t k = 0; k < R; ++k) w[(b * R + k) * N + j] = S(wcol[k]);
}

// f = c / S^((p-1)/p) per column (0 for a zero column); true where the sums are out of range (exact).
template <typename T, Kind K>
bool factors(const T* sums, const T* tops, int64_t n, const Config& cfg, double c, T* f, char* exact) {
  bool any = false;
  for (int64_t j = 0; j < n; ++j) {
    exact[j] = tops[j] != 0 && !in_range<T>(sums[j], tops[j], cfg.p);
    any |= exact[j];
    f[j] = tops[j] == 0 || exact[j] ? T(0) : T(factor(sums[j], cfg.p, c, K));
  }
  return any;
}

template <typename S, typename T, Kind K>
void col_tensor_step(const S* g, S* m, S* w, int64_t B, int64_t R, int64_t N, const Config& cfg, double c) {
  constexpr int64_t L = Vectorized<T>::size();
  const int64_t width = (N + L - 1) / L * L;
  std::vector<T> sums(B * width), tops(B * width), f(B * width, T(0));
  std::vector<char> exact(B * width, 0), slice_exact(B, 0);
  // Float storage: no maximum in sweep A; a slice with a column whose S alone cannot rule out a zero or
  // out-of-range column (sure_in_range) takes them in a second look (col_tops). bfloat16 rounds m where it
  // is stored, so a second look would not see sweep A's d: there sweep A tracks the maximum.
  constexpr bool tracked = !std::is_same_v<S, T>;
  col_sums<S, T, K>(g, m, B, R, N, cfg, sums.data(), tracked ? tops.data() : nullptr, width);
  for (int64_t b = 0; b < B; ++b) {
    T* top = tops.data() + b * width;
    if (!tracked) {
      const T* s = sums.data() + b * width;
      if (std::all_of(s, s + N, [&](T x) { return sure_in_range<T>(x, R); })) std::fill(top, top + N, T(1));
      else col_tops<S, T>(g, m, b, R, N, cfg, top);  // rare
    }
    slice_exact[b] = factors<T, K>(sums.data() + b * width, tops.data() + b * width, N, cfg, c, f.data() + b * width,
                                   exact.data() + b * width);
  }
  col_update<S, T, K>(g, m, w, B, R, N, cfg, f.data(), width, slice_exact.data());
  for (int64_t b = 0; b < B; ++b)  // rare: slices with a column to redo in double, redone whole
    if (slice_exact[b])
      for (int64_t j = 0; j < N; ++j) col_exact<S, T>(g, m, w, b, j, R, N, cfg, c);
}

// Storage S, math in T (float for bfloat16, converted a vector at a time: load_as, store_as).
template <typename S, typename T, Kind K>
void tensor_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& buf, int64_t B, int64_t R, int64_t N,
                 const Config& cfg, double c) {
  S* w = param.data_ptr<S>();
  const S* g = grad.data_ptr<S>();
  S* m = buf.defined() ? buf.data_ptr<S>() : nullptr;
  if (N == 1) {  // rows of length R
    at::parallel_for(0, B, row_grain(R), [&](int64_t lo, int64_t hi) {
      const int64_t off = lo * R;
      if constexpr (K == Kind::Sign) sign_rows<S, T>(g + off, m ? m + off : nullptr, w + off, hi - lo, R, cfg, c);
      else pipelined_rows<S, T, K>(g + off, m ? m + off : nullptr, w + off, hi - lo, R, cfg, c);
    });
    return;
  }
  col_tensor_step<S, T, K>(g, m, w, B, R, N, cfg, c);
}

// ---- dispatch and checks -------------------------------------------------------------------------

// The exponents with a fast path of their own (powered), and sign.
Kind kind_of(double p) {
  if (p == 1) return Kind::Sign;
  if (p == 2) return Kind::P2;
  if (p == 1.5) return Kind::P15;
  if (p == 2.5) return Kind::P25;
  return Kind::Generic;
}

template <Kind K>
using KindTag = std::integral_constant<Kind, K>;

// The one dtype x exponent dispatch: calls f(S(), T(), KindTag<K>()) for the tensor's storage S, its math
// T and the exponent's kind K.
template <typename F>
auto dispatch(at::ScalarType dtype, double p, F&& f) {
  auto by_kind = [&](auto s_tag, auto t_tag) {
    switch (kind_of(p)) {
      case Kind::Sign: return f(s_tag, t_tag, KindTag<Kind::Sign>());
      case Kind::P2: return f(s_tag, t_tag, KindTag<Kind::P2>());
      case Kind::P15: return f(s_tag, t_tag, KindTag<Kind::P15>());
      case Kind::P25: return f(s_tag, t_tag, KindTag<Kind::P25>());
      default: return f(s_tag, t_tag, KindTag<Kind::Generic>());
    }
  };
  switch (dtype) {
    case at::kFloat: return by_kind(float(), float());
    case at::kDouble: return by_kind(double(), double());
    case at::kBFloat16: return by_kind(c10::BFloat16(), float());
    default: TORCH_CHECK(false, "moga: float32, float64 or bfloat16 tensors, got ", dtype);
  }
}

// The one argument check, of every tensor before any is touched: per gradient g its parameter W (params
// empty for lmo_partials) and momentum buffer m (bufs empty without momentum), on the CPU, contiguous, of
// one dtype, with the B * R * N elements of its (B, R, N) in shapes.
void check_tensors(const char* op, at::TensorList params, at::TensorList grads, at::TensorList bufs,
                   at::IntArrayRef shapes) {
  const size_t n = grads.size();
  TORCH_CHECK(shapes.size() == 3 * n && (params.empty() || params.size() == n) && (bufs.empty() || bufs.size() == n),
              "moga ", op, ": list lengths differ (momentum buffers: none or one per tensor)");
  for (size_t k = 0; k < n; ++k) {
    const at::Tensor w = params.empty() ? at::Tensor() : params[k];
    const at::Tensor& g = grads[k];
    const at::Tensor m = bufs.empty() ? at::Tensor() : bufs[k];
    const int64_t B = shapes[3 * k], R = shapes[3 * k + 1], N = shapes[3 * k + 2];
    TORCH_CHECK(g.device().is_cpu() && (!w.defined() || w.device().is_cpu()) && (!m.defined() || m.device().is_cpu()),
                "moga ", op, ": CPU tensors only");
    TORCH_CHECK(g.is_contiguous() && (!w.defined() || w.is_contiguous()) && (!m.defined() || m.is_contiguous()),
                "moga ", op, ": tensors must be contiguous");
    TORCH_CHECK((!w.defined() || w.scalar_type() == g.scalar_type()) && (!m.defined() || m.scalar_type() == g.scalar_type()),
                "moga ", op, ": parameter, gradient and buffer dtypes differ");
    TORCH_CHECK(g.numel() == B * R * N && (!w.defined() || w.numel() == g.numel()) && (!m.defined() || m.numel() == g.numel()),
                "moga ", op, ": shape (", B, ", ", R, ", ", N, ") does not match a tensor of ", g.numel(), " elements");
  }
}

at::ScalarType compute_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
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
  TORCH_CHECK(grads.size() == n && scales.size() == n, "moga lmo_step: list lengths differ");
  TORCH_CHECK(p >= 1 && std::isfinite(p), "moga lmo_step: p must be finite and >= 1, got ", p);
  check_tensors("lmo_step", params, grads, bufs, shapes);
  if (flag_set(found_inf)) return;
  const Config cfg{p, bufs.empty() ? 0.0 : momentum, nesterov, decay};
  for (size_t back = 0; back < n; ++back) {
    const size_t k = n - 1 - back;
    const at::Tensor& w = params[k];
    const at::Tensor& g = grads[k];
    at::Tensor m = bufs.empty() ? at::Tensor() : bufs[k];
    const int64_t B = shapes[3 * k], R = shapes[3 * k + 1], N = shapes[3 * k + 2];
    if (w.numel() == 0) continue;
    dispatch(w.scalar_type(), p, [&](auto s, auto t, auto kind) {
      tensor_step<decltype(s), decltype(t), decltype(kind)::value>(w, g, m, B, R, N, cfg, scales[k]);
    });
  }
}

namespace {

// ---- sharded tensors: partial sums, then the update -------------------------------------------------
// A tensor whose normalized axis K is split over ranks (col on FSDP2's Shard(0), row on Shard(1)) steps in
// two calls around the caller's all-reduce: lmo_partials updates m and returns each row's or column's
// local S = sum |d|^p and a = max |d|; lmo_apply takes S summed and a maximized over the ranks and
// updates W. A row or column whose combined S is out of range is left untouched and flagged: its exact
// step needs one more reduction over the ranks, which the caller makes.

template <typename S, typename T, Kind K>
void row_sums(const S* g, S* m, int64_t B, int64_t R, const Config& cfg, T* sums, T* tops) {
  using V = Vectorized<T>;
  constexpr int64_t L = V::size();
  const V e = V(T(cfg.p - 1));
  const Ema<T> ema(cfg);
  at::parallel_for(0, B, row_grain(R), [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t off = b * R;
      Vectorized<T> s(T(0)), peak(T(0));
      for (int64_t i = 0; i < R; i += L) {
        const int64_t cnt = std::min(L, R - i);
        pass_a<S, T, K>(g + off + i, m ? m + off + i : nullptr, cnt, ema, e, s, nullptr, &peak);  // lanes past cnt: 0
      }
      sums[b] = horizontal_sum(s);
      tops[b] = horizontal_max(peak);
    }
  });
}

template <typename S, typename T, Kind K>
void row_update(const S* g, const S* m, S* w, int64_t B, int64_t R, const Config& cfg, const T* f, const char* skip) {
  using V = Vectorized<T>;
  constexpr int64_t L = V::size();
  const V e = V(T(cfg.p - 1)), decay(T(cfg.decay));
  const Ema<T> ema(cfg);
  at::parallel_for(0, B, row_grain(R), [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      if (skip[b]) continue;
      const int64_t off = b * R;
      const V fv(f[b]);
      for (int64_t i = 0; i < R; i += L) {
        const int64_t cnt = std::min(L, R - i);
        pass_b(w + off + i, t_again<S, T, K>(g + off + i, m ? m + off + i : nullptr, cnt, ema, e), fv, decay, cnt);
      }
    }
  });
}

template <typename S, typename T, Kind K>
void partials(const at::Tensor& grad, const at::Tensor& buf, int64_t B, int64_t R, int64_t N, const Config& cfg,
              at::Tensor& out) {
  const S* g = grad.data_ptr<S>();
  S* m = buf.defined() ? buf.data_ptr<S>() : nullptr;
  T* sums = out.data_ptr<T>();
  if (N == 1) row_sums<S, T, K>(g, m, B, R, cfg, sums, sums + B);
  else col_sums<S, T, K>(g, m, B, R, N, cfg, sums, sums + B * N, N);
}

// Updates W from the combined sums; returns the (B, N) flags of the rows or columns left to the caller.
template <typename S, typename T, Kind K>
at::Tensor apply(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& buf, const at::Tensor& combined,
                 int64_t B, int64_t R, int64_t N, const Config& cfg, double c) {
  const S* g = grad.data_ptr<S>();
  const S* m = buf.defined() ? buf.data_ptr<S>() : nullptr;
  S* w = param.data_ptr<S>();
  const at::Tensor sums = combined.contiguous();
  const T* s = sums.data_ptr<T>();
  std::vector<T> f(B * N);
  at::Tensor flags = at::zeros({B, N}, at::kBool);
  char* exact = reinterpret_cast<char*>(flags.data_ptr<bool>());
  const bool any = factors<T, K>(s, s + B * N, B * N, cfg, c, f.data(), exact);
  if (N == 1) {
    row_update<S, T, K>(g, m, w, B, R, cfg, f.data(), exact);
    return flags;
  }
  std::vector<S> kept;  // rare: the flagged columns of W, put back after the sweep (which decays them)
  if (any)
    for (int64_t bj = 0; bj < B * N; ++bj)
      if (exact[bj])
        for (int64_t k = 0; k < R; ++k) kept.push_back(w[((bj / N) * R + k) * N + bj % N]);
  const std::vector<char> none(B, 0);
  col_update<S, T, K>(g, m, w, B, R, N, cfg, f.data(), N, none.data());
  size_t next = 0;
  if (any)
    for (int64_t bj = 0; bj < B * N; ++bj)
      if (exact[bj])
        for (int64_t k = 0; k < R; ++k) w[((bj / N) * R + k) * N + bj % N] = kept[next++];
  return flags;
}

}  // namespace

// Per tensor a (2, B, N) tensor in the math dtype: the local sums |d|^p and maxima |d| along K, after the
// momentum update. Zeros, and m untouched, when found_inf is set.
std::vector<at::Tensor> lmo_partials(at::TensorList grads, at::TensorList bufs, const std::optional<at::Tensor>& found_inf,
                                     at::IntArrayRef shapes, double p, double momentum, bool nesterov) {
  const size_t n = grads.size();
  TORCH_CHECK(p > 1 && std::isfinite(p), "moga lmo_partials: p must be finite and > 1, got ", p);
  check_tensors("lmo_partials", {}, grads, bufs, shapes);
  const bool skip = flag_set(found_inf);
  const Config cfg{p, bufs.empty() ? 0.0 : momentum, nesterov, 1.0};
  std::vector<at::Tensor> out;
  for (size_t k = 0; k < n; ++k) {
    const int64_t B = shapes[3 * k], R = shapes[3 * k + 1], N = shapes[3 * k + 2];
    const at::Tensor& g = grads[k];
    const at::Tensor m = bufs.empty() ? at::Tensor() : bufs[k];
    at::Tensor part = at::zeros({2, B, N}, g.options().dtype(compute_dtype(g)));
    if (!skip && g.numel())
      dispatch(g.scalar_type(), p, [&](auto s, auto t, auto kind) {
        partials<decltype(s), decltype(t), decltype(kind)::value>(g, m, B, R, N, cfg, part);
      });
    out.push_back(part);
  }
  return out;
}

// W <- decay W + c phi_p(d) with the combined (2, B, N) sums of lmo_partials; returns per tensor the (B, N)
// flags of rows or columns left untouched, whose sums are out of range (none when found_inf is set).
std::vector<at::Tensor> lmo_apply(at::TensorList params, at::TensorList grads, at::TensorList bufs,
                                  const std::optional<at::Tensor>& found_inf, at::IntArrayRef shapes,
                                  at::ArrayRef<double> scales, at::TensorList combined, double p, double momentum,
                                  bool nesterov, double decay) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && scales.size() == n && combined.size() == n, "moga lmo_apply: list lengths differ");
  TORCH_CHECK(p > 1 && std::isfinite(p), "moga lmo_apply: p must be finite and > 1, got ", p);
  check_tensors("lmo_apply", params, grads, bufs, shapes);
  for (size_t k = 0; k < n; ++k)
    TORCH_CHECK(combined[k].scalar_type() == compute_dtype(grads[k]) && combined[k].numel() == 2 * shapes[3 * k] * shapes[3 * k + 2],
                "moga lmo_apply: sums must be lmo_partials' (2, B, N) in the math dtype");
  const bool skip = flag_set(found_inf);
  const Config cfg{p, bufs.empty() ? 0.0 : momentum, nesterov, decay};
  std::vector<at::Tensor> flags;
  for (size_t k = 0; k < n; ++k) {
    const int64_t B = shapes[3 * k], R = shapes[3 * k + 1], N = shapes[3 * k + 2];
    const at::Tensor& w = params[k];
    const at::Tensor& g = grads[k];
    const at::Tensor m = bufs.empty() ? at::Tensor() : bufs[k];
    if (skip) {
      flags.push_back(at::zeros({B, N}, at::kBool));
      continue;
    }  // an empty shard still flags what the others flag: the caller's next reduction must match
    flags.push_back(dispatch(w.scalar_type(), p, [&](auto s, auto t, auto kind) {
      return apply<decltype(s), decltype(t), decltype(kind)::value>(w, g, m, combined[k], B, R, N, cfg, scales[k]);
    }));
  }
  return flags;
}

namespace {

// Whether x[lo, hi) holds a NaN or inf: x * 0 is 0 for every finite x and NaN otherwise, so a sum of
// them is exact, without overflow. Four chains from four parts of the range: more reads in flight.
template <typename scalar_t>
bool any_nonfinite(const scalar_t* x, int64_t lo, int64_t hi) {
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>) {
    using V = Vectorized<scalar_t>;
    constexpr int64_t L = V::size();
    V acc0(scalar_t(0)), acc1(scalar_t(0)), acc2(scalar_t(0)), acc3(scalar_t(0));
    const V zero(scalar_t(0));
    const int64_t q = (hi - lo) / (4 * L) * L;
    for (int64_t j = 0; j < q; j += L) {
      acc0 = at::vec::fmadd(V::loadu(x + lo + j), zero, acc0);
      acc1 = at::vec::fmadd(V::loadu(x + lo + q + j), zero, acc1);
      acc2 = at::vec::fmadd(V::loadu(x + lo + 2 * q + j), zero, acc2);
      acc3 = at::vec::fmadd(V::loadu(x + lo + 3 * q + j), zero, acc3);
    }
    scalar_t rest = 0;
    for (int64_t i = lo + 4 * q; i < hi; ++i) rest += x[i] * scalar_t(0);
    return std::isnan(horizontal_sum((acc0 + acc1) + (acc2 + acc3)) + rest);
  } else {
    float acc = 0;
    for (int64_t i = lo; i < hi; ++i) acc += float(x[i]) * 0.0f;
    return std::isnan(acc);
  }
}

}  // namespace

// 1.0 when any element of any tensor is NaN or inf, else 0.0: one read-only pass, in one parallel
// region over all the tensors end to end (a region per tensor measured ~1.5% slower on GPT-2 shapes).
at::Tensor found_nonfinite(at::TensorList tensors) {
  std::vector<at::Tensor> parts;
  std::vector<int64_t> starts{0};
  for (const at::Tensor& t : tensors) {
    if (t.numel() == 0) continue;
    TORCH_CHECK(t.device().is_cpu(), "moga found_nonfinite: CPU tensors only");
    parts.push_back(t.contiguous());
    starts.push_back(starts.back() + t.numel());
  }
  std::atomic<bool> any{false};
  at::parallel_for(0, starts.back(), 65536, [&](int64_t lo, int64_t hi) {
    size_t k = std::upper_bound(starts.begin(), starts.end(), lo) - starts.begin() - 1;
    for (; k < parts.size() && starts[k] < hi && !any.load(std::memory_order_relaxed); ++k) {
      const int64_t a = std::max(lo, starts[k]) - starts[k], b = std::min(hi, starts[k + 1]) - starts[k];
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, parts[k].scalar_type(), "found_nonfinite", [&] {
        if (any_nonfinite(parts[k].data_ptr<scalar_t>(), a, b)) any = true;
      });
    }
  });
  return at::scalar_tensor(any.load() ? 1.0 : 0.0, at::kFloat);
}

// Plain ops of the compiled library; moga.kernels.ops wraps them in the public moga:: custom ops.
TORCH_LIBRARY(moga_kernels, m) {
  m.def("lmo_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] bufs, Tensor? found_inf, int[] shapes, "
        "float[] scales, float p, float momentum, bool nesterov, float decay) -> ()");
  m.def("found_nonfinite(Tensor[] tensors) -> Tensor");
  m.def("lmo_partials(Tensor[] grads, Tensor(a!)[] bufs, Tensor? found_inf, int[] shapes, float p, float momentum, "
        "bool nesterov) -> Tensor[]");
  m.def("lmo_apply(Tensor(a!)[] params, Tensor[] grads, Tensor[] bufs, Tensor? found_inf, int[] shapes, "
        "float[] scales, Tensor[] combined, float p, float momentum, bool nesterov, float decay) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(moga_kernels, CPU, m) {
  m.impl("lmo_step", &lmo_step);
  m.impl("found_nonfinite", &found_nonfinite);
  m.impl("lmo_partials", &lmo_partials);
  m.impl("lmo_apply", &lmo_apply);
}
