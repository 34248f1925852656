// CPU kernels of the ``native`` rows (astrai.backends.native), compiled into astrai's
// native extension beside the facades' hot path (astrai.native builds both).
//
// Each kernel computes, in one pass over memory, exactly what the reference rows write
// out op by op - the same operations in the same types, each result rounded where the
// reference rounds it - so that on the calls it serves its output equals the
// reference's (rotary: bit for bit; RMS norm: up to the order of the sum of squares).
// A kernel serves CPU tensors of the dtypes it takes that autograd need not see, and
// answers None for any other call (the Python row then computes it with torch's
// operations); a malformed call is a Python error, never a crash.
//
// Inputs may be any view - overlapping (``unfold``, ``as_strided``), broadcast (zero
// strides), empty: a kernel reads them through their strides or a contiguous copy, and
// writes only into an output it allocated, in a layout whose strides it walks (rows of
// stride 1, never two elements in one place). The rows of a call are split among torch's
// intra-op threads (``torch.get_num_threads()``), each row computed whole by one thread in
// one order, so a result does not depend on the number of threads.

#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/autocast_mode.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// hot.cpp's reading of a plain tensor: exactly a Tensor or Parameter, strided, not
// nested, no Python dispatch, no symbolic sizes, no __torch_function__ mode in force.
bool astrai_plain_tensor(PyObject* obj);
// Whether the tensor types are bound (hot.cpp); false with a RuntimeError set otherwise.
bool astrai_set_up();

namespace {

// The type a reduced-precision value is computed in (torch's ``opmath``): float for the
// half types and float, double for double.
template <typename T> struct Op { using type = float; };
template <> struct Op<double> { using type = double; };
template <typename T> using op_t = typename Op<T>::type;

// Conversions between a type and its opmath type, as torch rounds them. bfloat16's are
// written out (c10's branch on NaN keeps loops from vectorising): widening is a shift,
// narrowing rounds to nearest even, and every NaN becomes the quiet NaN c10 gives.
template <typename To, typename From> inline To cast_to(From v) { return static_cast<To>(v); }
template <> inline float cast_to<float, c10::BFloat16>(c10::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}
template <> inline c10::BFloat16 cast_to<c10::BFloat16, float>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  uint16_t out = std::isnan(v) ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(rounded);
  return c10::BFloat16(out, c10::BFloat16::from_bits());
}

bool kernel_dtype(c10::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// The GIL released for a kernel's work, taken back however the work ends.
struct WithoutGil {
  PyThreadState* state = PyEval_SaveThread();
  ~WithoutGil() { PyEval_RestoreThread(state); }
};

// Rows per task when ``at::parallel_for`` splits rows of ``width`` elements among threads:
// at least torch's grain (32768 elements) per task, below which starting a thread costs
// more than it saves.
int64_t row_grain(int64_t width) {
  constexpr int64_t kGrain = 32768;
  return std::max<int64_t>(1, kGrain / std::max<int64_t>(1, width));
}

PyObject* fail(PyObject* type, const char* message) {
  PyErr_SetString(type, message);
  return nullptr;
}

// Whether ``t`` carries only the dispatch keys of an ordinary CPU tensor: no functorch
// wrapper (vmap, grad transforms), no lazy negation or conjugation, no functionalization.
bool ordinary_keys(const at::Tensor& t) {
  for (c10::DispatchKey key : t.key_set()) {
    if (key != c10::DispatchKey::CPU && key != c10::DispatchKey::AutogradCPU &&
        key != c10::DispatchKey::ADInplaceOrView && key != c10::DispatchKey::AutocastCPU)
      return false;
  }
  return true;
}

// Whether something watches torch's operations in this thread - a dispatch mode (fake
// tensors, make_fx, export) or a JIT trace: then only torch's own kernels may run.
bool watched() {
  return c10::impl::TorchDispatchModeTLS::any_modes_set() || torch::jit::tracer::isTracing();
}

// Whether the kernels serve the tensor ``t`` (held by ``obj``), in a thread nothing
// ``watched``: a plain CPU tensor of a kernel dtype with no forward-mode tangent, that
// autograd need not see (grad mode off, or ``t`` needs no gradient). The row computes any
// other call with torch's operations.
bool served(PyObject* obj, const at::Tensor& t) {
  return astrai_plain_tensor(obj) && ordinary_keys(t) && t.device().is_cpu() &&
         kernel_dtype(t.scalar_type()) &&
         !(at::GradMode::is_enabled() && t.requires_grad()) && !t._fw_grad(0).defined();
}

// The tensor ``obj`` holds, or nullptr with a TypeError set when it holds none. Read off
// its own type, not what its ``__class__`` says (which may run Python code, or raise).
const at::Tensor* tensor(PyObject* obj, const char* what) {
  if (THPVariableClass == nullptr ||
      !PyObject_TypeCheck(obj, reinterpret_cast<PyTypeObject*>(THPVariableClass))) {
    PyErr_Format(PyExc_TypeError, "%s must be a tensor", what);
    return nullptr;
  }
  return &THPVariable_Unpack(obj);
}

// -- RMS norm ------------------------------------------------------------------------

// One row of f values: the mean of squares in C, then ``x * rsqrt(mean + eps)`` in C
// (``normed``). Eight partial sums per block of 1024 values (the compiler may keep them in
// vector registers), the blocks' sums added in double: a wide row loses no more to
// rounding than torch's cascade sum does.
template <typename X, typename C>
C inverse_rms(const X* x, int64_t f, C eps) {
  constexpr int64_t kBlock = 1024;
  double total = 0;
  for (int64_t start = 0; start < f; start += kBlock) {
    const int64_t end = std::min(f, start + kBlock);
    C part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = start;
    for (; i + 8 <= end; i += 8) {
      for (int j = 0; j < 8; ++j) {
        C v = cast_to<C, X>(x[i + j]);
        part[j] += v * v;
      }
    }
    C sum = 0;
    for (; i < end; ++i) {
      C v = cast_to<C, X>(x[i]);
      sum += v * v;
    }
    sum += ((part[0] + part[1]) + (part[2] + part[3])) +
           ((part[4] + part[5]) + (part[6] + part[7]));
    total += static_cast<double>(sum);
  }
  C mean = static_cast<C>(total) / static_cast<C>(f);
  return static_cast<C>(1) / std::sqrt(mean + eps);
}

// The weight as the forms apply it, once per call, each in a loop of its own that
// vectorises (a test inside the loop, or the loop inlined into the kernel's dispatch,
// kept GCC from vectorising it). ``weight_after``: ``weight + offset`` in C, the weight
// taken to C first; ``weight_cast``: ``weight + offset`` as torch's tensor-plus-scalar
// computes it - the scalar taken to W, the sum computed in W's opmath type and rounded to
// W - then taken to A.
template <typename W, typename C>
__attribute__((noinline)) void weight_after(const W* __restrict__ w, C* __restrict__ scale,
                                            int64_t f, double offset) {
  const C off = static_cast<C>(offset);
  if (offset != 0) {
    for (int64_t j = 0; j < f; ++j) scale[j] = cast_to<C, W>(w[j]) + off;
  } else {
    for (int64_t j = 0; j < f; ++j) scale[j] = cast_to<C, W>(w[j]);
  }
}

template <typename W, typename A>
__attribute__((noinline)) void weight_cast(const W* __restrict__ w, A* __restrict__ scale,
                                           int64_t f, double offset) {
  using WA = op_t<W>;
  const WA off = cast_to<WA, W>(static_cast<W>(offset));
  if (offset != 0) {
    for (int64_t j = 0; j < f; ++j)
      scale[j] = cast_to<A, W>(cast_to<W, WA>(cast_to<WA, W>(w[j]) + off));
  } else {
    for (int64_t j = 0; j < f; ++j) scale[j] = cast_to<A, W>(w[j]);
  }
}

// Rows [begin, end) of ``rms_rows_after``: ``scale`` is ``weight + offset`` in C. A function
// of its own, not inlined, every argument a value and the output known to alias no input
// (it is the kernel's fresh tensor): its loops vectorise as they did in one thread's
// kernel.
template <typename X, typename C>
__attribute__((noinline)) void rms_after_range(const X* __restrict__ x,
                                               const C* __restrict__ scale,
                                               X* __restrict__ out, int64_t begin, int64_t end,
                                               int64_t f, C eps) {
  for (int64_t r = begin; r < end; ++r) {
    const X* xr = x + r * f;
    X* o = out + r * f;
    C inv = inverse_rms<X, C>(xr, f, eps);
    for (int64_t j = 0; j < f; ++j) {
      C normed = cast_to<C, X>(xr[j]) * inv;
      o[j] = cast_to<X, C>(normed * scale[j]);
    }
  }
}

// The weight applied after the norm in C: ``(normed * (weight + offset)).to(X)``, the
// weight taken to C first (the plain form and Gemma's offset form).
template <typename X, typename W>
void rms_rows_after(const X* x, const W* w, X* out, int64_t rows, int64_t f, double eps,
                    double offset) {
  using C = op_t<X>;
  std::vector<C> scale(static_cast<size_t>(f));
  weight_after(w, scale.data(), f, offset);
  const C* sc = scale.data();
  const C e = static_cast<C>(eps);
  at::parallel_for(0, rows, row_grain(f), [=](int64_t begin, int64_t end) {
    rms_after_range<X, C>(x, sc, out, begin, end, f, e);
  });
}

// Rows [begin, end) of ``rms_rows_cast``: ``scale`` is ``weight + offset`` rounded to W,
// in A (see ``rms_after_range``).
template <typename X, typename O, typename C, typename A>
__attribute__((noinline)) void rms_cast_range(const X* __restrict__ x,
                                              const A* __restrict__ scale,
                                              O* __restrict__ out, int64_t begin, int64_t end,
                                              int64_t f, C eps) {
  for (int64_t r = begin; r < end; ++r) {
    const X* xr = x + r * f;
    O* o = out + r * f;
    C inv = inverse_rms<X, C>(xr, f, eps);
    for (int64_t j = 0; j < f; ++j) {
      X normed = cast_to<X, C>(cast_to<C, X>(xr[j]) * inv);
      o[j] = cast_to<O, A>(scale[j] * cast_to<A, X>(normed));
    }
  }
}

// LlamaRMSNorm's form: ``(weight + offset) * normed.to(X)``, the product taken in O's type
// (O = promote(W, X)). ``weight + offset`` is torch's tensor-plus-scalar: the scalar taken
// to W first, the sum computed in W's opmath type and rounded to W.
template <typename X, typename W, typename O>
void rms_rows_cast(const X* x, const W* w, O* out, int64_t rows, int64_t f, double eps,
                   double offset) {
  using C = op_t<X>;
  using A = op_t<O>;
  std::vector<A> scale(static_cast<size_t>(f));
  weight_cast(w, scale.data(), f, offset);
  const A* sc = scale.data();
  const C e = static_cast<C>(eps);
  at::parallel_for(0, rows, row_grain(f), [=](int64_t begin, int64_t end) {
    rms_cast_range<X, O, C, A>(x, sc, out, begin, end, f, e);
  });
}

// rms_norm(x, weight, eps, weight_offset, cast_before_weight) -> Tensor, or None for a call
// the kernel does not serve (see ``served``).
PyObject* rms_norm_kernel(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (!astrai_set_up()) return nullptr;
  if (n != 5) return fail(PyExc_TypeError, "rms_norm_kernel(x, weight, eps, weight_offset, "
                                           "cast_before_weight)");
  const at::Tensor* xp = tensor(args[0], "x");
  if (xp == nullptr) return nullptr;
  const at::Tensor* wp = tensor(args[1], "weight");
  if (wp == nullptr) return nullptr;
  // The scalars first: reading them may run Python code (__float__, __bool__), which may
  // change what ``served`` reads of the tensors.
  double eps = PyFloat_AsDouble(args[2]);
  if (eps == -1.0 && PyErr_Occurred()) return nullptr;
  double offset = PyFloat_AsDouble(args[3]);
  if (offset == -1.0 && PyErr_Occurred()) return nullptr;
  int cast = PyObject_IsTrue(args[4]);
  if (cast < 0) return nullptr;
  if (watched() || !served(args[0], *xp) || !served(args[1], *wp)) Py_RETURN_NONE;
  try {
    if (xp->dim() < 1 || wp->dim() != 1 || wp->size(0) != xp->size(-1))
      return fail(PyExc_ValueError, "rms_norm_kernel: weight must be [x.shape[-1]]");
    // x and the weight read as contiguous rows (a view that overlaps or broadcasts is
    // copied), the output a fresh contiguous tensor.
    at::Tensor x = xp->contiguous();
    at::Tensor w = wp->contiguous();
    int64_t f = x.size(-1);
    int64_t rows = f == 0 ? 0 : x.numel() / f;
    c10::ScalarType out_type =
        cast ? c10::promoteTypes(w.scalar_type(), x.scalar_type()) : x.scalar_type();
    at::Tensor out = at::empty(x.sizes(), x.options().dtype(out_type));
    {
      WithoutGil released;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_x", [&] {
        using X = scalar_t;
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w.scalar_type(), "rms_w", [&] {
          using W = scalar_t;
          if (!cast) {
            rms_rows_after<X, W>(x.data_ptr<X>(), w.data_ptr<W>(), out.data_ptr<X>(), rows, f,
                                 eps, offset);
            return;
          }
          AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_type, "rms_o", [&] {
            rms_rows_cast<X, W, scalar_t>(x.data_ptr<X>(), w.data_ptr<W>(),
                                          out.data_ptr<scalar_t>(), rows, f, eps, offset);
          });
        });
      });
    }
    return THPVariable_Wrap(out);
  } catch (const std::exception& e) {
    return fail(PyExc_RuntimeError, e.what());
  }
}

// -- rotary, half layout -------------------------------------------------------------

// The leading dimensions of a rotary call: their sizes, and x's, cos's and out's strides
// along them.
struct Lead {
  std::vector<int64_t> size, xs, cs, os;
};

// Rows [begin, end) of ``rotate_rows``, walked from the row ``begin`` with an odometer over
// the leading dimensions. A function of its own, not inlined, every scalar a value and the
// output known to alias no input (see ``rms_after_range``).
template <typename T>
__attribute__((noinline)) void rotate_range(const T* __restrict__ xb, const T* __restrict__ cb,
                                            const T* __restrict__ sb, T* __restrict__ ob,
                                            const Lead& lead, int64_t d, int64_t begin,
                                            int64_t end) {
  using A = op_t<T>;
  const int64_t h = d / 2;
  const int64_t nl = static_cast<int64_t>(lead.size.size());
  const int64_t* size = lead.size.data();
  const int64_t* xs = lead.xs.data();
  const int64_t* cs = lead.cs.data();
  const int64_t* os = lead.os.data();
  auto mul = [](T a, T b) { return cast_to<T, A>(cast_to<A, T>(a) * cast_to<A, T>(b)); };
  auto add = [](T a, T b) { return cast_to<T, A>(cast_to<A, T>(a) + cast_to<A, T>(b)); };
  // the leading index of row ``begin``, and its offsets
  std::vector<int64_t> index(static_cast<size_t>(nl), 0);
  int64_t xo = 0, co = 0, oo = 0;
  int64_t rest = begin;
  for (int64_t dim = nl - 1; dim >= 0; --dim) {
    index[dim] = rest % size[dim];
    rest /= size[dim];
    xo += index[dim] * xs[dim];
    co += index[dim] * cs[dim];
    oo += index[dim] * os[dim];
  }
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = xb + xo;
    const T* c = cb + co;
    const T* s = sb + co;
    T* o = ob + oo;
    for (int64_t i = 0; i < h; ++i) {
      T first = mul(xr[i], c[i]);
      T second = mul(cast_to<T, A>(-cast_to<A, T>(xr[i + h])), s[i]);
      o[i] = add(first, second);
    }
    for (int64_t i = h; i < d; ++i) {
      T first = mul(xr[i], c[i]);
      T second = mul(xr[i - h], s[i]);
      o[i] = add(first, second);
    }
    // the next row: an odometer over the leading dimensions
    for (int64_t dim = nl - 1; dim >= 0; --dim) {
      if (++index[dim] < size[dim]) {
        xo += xs[dim];
        co += cs[dim];
        oo += os[dim];
        break;
      }
      xo -= xs[dim] * (size[dim] - 1);
      co -= cs[dim] * (size[dim] - 1);
      oo -= os[dim] * (size[dim] - 1);
      index[dim] = 0;
    }
  }
}

// ``x * cos + rotate_half(x) * sin`` for every row (the last dimension, d = 2h) of x,
// each product and the sum rounded to T as torch's elementwise ops round them.
// Rows are walked over x's leading dimensions with x's, cos's and out's strides (cos's are
// sin's: the caller made both contiguous before broadcasting them alike); the last
// dimension of x, cos and out has stride 1 (the caller's), and out's rows do not overlap.
template <typename T>
void rotate_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                 at::Tensor& out) {
  const int64_t nd = x.dim();
  const int64_t d = x.size(nd - 1);
  auto leading = [](at::IntArrayRef v) { return std::vector<int64_t>(v.begin(), v.end() - 1); };
  const Lead lead{leading(x.sizes()), leading(x.strides()), leading(cos.strides()),
                  leading(out.strides())};
  int64_t rows = 1;
  for (int64_t n : lead.size) rows *= n;
  const T* xb = x.data_ptr<T>();
  const T* cb = cos.data_ptr<T>();
  const T* sb = sin.data_ptr<T>();
  T* ob = out.data_ptr<T>();
  at::parallel_for(0, rows, row_grain(d), [&lead, xb, cb, sb, ob, d](int64_t begin,
                                                                     int64_t end) {
    rotate_range<T>(xb, cb, sb, ob, lead, d, begin, end);
  });
}

// ``rotate_rows`` on x, with ``cos`` and ``sin`` contiguous (the caller's: small, [batch or
// 1, seq, d], made so once for q and k, so that one set of strides walks both).
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                  int64_t dim) {
  // x's last dimension read with stride 1 (its rows may overlap: they are only read); cos
  // and sin broadcast to x as transformers' ``cos.unsqueeze(unsqueeze_dim)`` does (expand
  // raises where they do not fit).
  at::Tensor xc = x.stride(-1) == 1 ? x : x.contiguous();
  at::Tensor c = cos.unsqueeze(dim).expand(xc.sizes());
  at::Tensor s = sin.unsqueeze(dim).expand(xc.sizes());
  // x's layout where it is one the rows can be written in; empty_like of a view that
  // overlaps or broadcasts orders its strides from x's, and may give the last dimension a
  // stride other than 1: such an x gets a contiguous output.
  at::Tensor out = at::empty_like(xc);
  if (out.size(-1) > 1 && out.stride(-1) != 1) out = at::empty(xc.sizes(), xc.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, xc.scalar_type(), "rotary_half",
                                  [&] { rotate_rows<scalar_t>(xc, c, s, out); });
  return out;
}

// rotary_half(q, k, cos, sin, unsqueeze_dim) -> (q_out, k_out), or None for a call the
// kernel does not serve (see ``served``; and q, k, cos and sin of more than one dtype).
PyObject* rotary_half_kernel(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (!astrai_set_up()) return nullptr;
  if (n != 5) return fail(PyExc_TypeError, "rotary_half_kernel(q, k, cos, sin, unsqueeze_dim)");
  const char* names[] = {"q", "k", "cos", "sin"};
  const at::Tensor* t[4];
  for (int i = 0; i < 4; ++i) {
    t[i] = tensor(args[i], names[i]);
    if (t[i] == nullptr) return nullptr;
  }
  long dim = PyLong_AsLong(args[4]);
  if (dim == -1 && PyErr_Occurred()) return nullptr;
  const at::Tensor &q = *t[0], &k = *t[1], &cos = *t[2], &sin = *t[3];
  try {
    if (watched()) Py_RETURN_NONE;
    c10::ScalarType type = q.scalar_type();
    for (int i = 0; i < 4; ++i) {
      if (!served(args[i], *t[i]) || t[i]->scalar_type() != type) Py_RETURN_NONE;
    }
    int64_t nd = q.dim();
    int64_t heads = dim < 0 ? dim + nd : dim;  // the axis cos and sin are broadcast along
    if ((nd != 3 && nd != 4) || k.dim() != nd || cos.dim() != nd - 1 ||
        cos.sizes() != sin.sizes() || q.size(-1) % 2 != 0 || cos.size(-1) != q.size(-1) ||
        k.size(-1) != q.size(-1) || heads < 0 || heads >= nd - 1)
      return fail(PyExc_ValueError, "rotary_half_kernel: q, k [..., d] (d even) with cos = "
                                    "sin [..., d] one dimension fewer, unsqueeze_dim not d's");
    at::Tensor q_out, k_out;
    {
      WithoutGil released;
      at::Tensor c = cos.contiguous(), s = sin.contiguous();
      q_out = rotate(q, c, s, dim);
      k_out = rotate(k, c, s, dim);
    }
    PyObject* a = THPVariable_Wrap(q_out);
    if (a == nullptr) return nullptr;
    PyObject* b = THPVariable_Wrap(k_out);
    if (b == nullptr) {
      Py_DECREF(a);
      return nullptr;
    }
    PyObject* pair = PyTuple_New(2);
    if (pair == nullptr) {
      Py_DECREF(a);
      Py_DECREF(b);
      return nullptr;
    }
    PyTuple_SET_ITEM(pair, 0, a);
    PyTuple_SET_ITEM(pair, 1, b);
    return pair;
  } catch (const std::exception& e) {
    return fail(PyExc_ValueError, e.what());
  }
}

// -- linear, a few rows --------------------------------------------------------------

// ``x @ weight.T + bias`` for a few rows of x (a decode step's one token), float32, the
// weight read as it is stored ([out, in], each row contiguous) and exactly once per group
// of ``kGroup`` rows of x. Eight weight rows at a time, each against every row of x, in
// eight float32 lanes: lane j of an output sums the products of the inputs j, j + 8, ...
// in order; the lanes are then added pairwise (0+4, 2+6, 1+5, 3+7, as ``lanes_sum``), the
// tail of the row (in % 8 values) after them in order, the bias last. Every output is
// computed whole by one thread in this one order, whatever block or thread it falls in,
// so the result does not depend on the number of threads; it equals F.linear's up to the
// order of the sums. Products and sums are rounded separately (no fused multiply-add).
//
// Built twice where the compiler can (GCC on x86-64): for x86-64-v3 (AVX2, 256-bit
// vectors) and for the baseline, the loader picking the one this CPU runs. The baseline
// build was measured slower than torch's own product (0.8x), so the row asks
// ``linear_rows_vectorised`` and is unavailable where it says no.

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ASTRAI_LINEAR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#define ASTRAI_LINEAR_VECTORISED 1
#else
#define ASTRAI_LINEAR_CLONES
#define ASTRAI_LINEAR_VECTORISED 0
#endif

typedef float lanes8 __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;
constexpr int64_t kBlock = 8;  // weight rows read together
constexpr int64_t kGroup = 4;  // rows of x served by one pass over the weight

__attribute__((always_inline)) inline lanes8 load8(const float* p) {
  lanes8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

__attribute__((always_inline)) inline float lanes_sum(lanes8 v) {
  float a[kLanes];
  std::memcpy(a, &v, sizeof v);
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

// Outputs [o, o + R) of the M rows of x (x rows ``in`` apart, y rows ``out`` apart).
// Always inlined, so that it is compiled within each build of ``linear_blocks``.
template <int M, int R>
__attribute__((always_inline)) inline void linear_block(
    const float* __restrict__ x, const float* __restrict__ w, int64_t ws,
    const float* __restrict__ b, float* __restrict__ y, int64_t in, int64_t out, int64_t o) {
  const int64_t whole = in - in % kLanes;
  const float* w0 = w + o * ws;
  lanes8 acc[M][R] = {};
  for (int64_t i = 0; i < whole; i += kLanes) {
    lanes8 a[R];
    for (int r = 0; r < R; ++r) a[r] = load8(w0 + r * ws + i);
    for (int m = 0; m < M; ++m) {
      lanes8 xv = load8(x + m * in + i);
      for (int r = 0; r < R; ++r) acc[m][r] += a[r] * xv;
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < R; ++r) {
      float s = lanes_sum(acc[m][r]);
      const float* wr = w0 + r * ws;
      for (int64_t i = whole; i < in; ++i) s += wr[i] * x[m * in + i];
      y[m * out + o + r] = b == nullptr ? s : s + b[o + r];
    }
  }
}

// The blocks [first, last) of kBlock outputs (the last one may be short) for M rows of x.
template <int M>
ASTRAI_LINEAR_CLONES __attribute__((noinline)) void linear_blocks(
    const float* __restrict__ x, const float* __restrict__ w, int64_t ws,
    const float* __restrict__ b, float* __restrict__ y, int64_t in, int64_t out,
    int64_t first, int64_t last) {
  for (int64_t block = first; block < last; ++block) {
    int64_t o = block * kBlock;
    if (o + kBlock <= out) {
      linear_block<M, kBlock>(x, w, ws, b, y, in, out, o);
    } else {
      for (; o < out; ++o) linear_block<M, 1>(x, w, ws, b, y, in, out, o);
    }
  }
}

void linear_rows(const float* x, const float* w, int64_t ws, const float* b, float* y,
                 int64_t rows, int64_t in, int64_t out) {
  const int64_t blocks = (out + kBlock - 1) / kBlock;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, kBlock * in));
  for (int64_t r = 0; r < rows; r += kGroup) {
    const int64_t m = std::min(kGroup, rows - r);
    const float* xr = x + r * in;
    float* yr = y + r * out;
    at::parallel_for(0, blocks, grain, [=](int64_t first, int64_t last) {
      switch (m) {
        case 1: linear_blocks<1>(xr, w, ws, b, yr, in, out, first, last); break;
        case 2: linear_blocks<2>(xr, w, ws, b, yr, in, out, first, last); break;
        case 3: linear_blocks<3>(xr, w, ws, b, yr, in, out, first, last); break;
        default: linear_blocks<4>(xr, w, ws, b, yr, in, out, first, last); break;
      }
    });
  }
}

// Whether ``linear_rows`` runs its vector build on this CPU (x86-64-v3).
bool linear_vectorised() {
#if ASTRAI_LINEAR_VECTORISED
  __builtin_cpu_init();
  return __builtin_cpu_supports("x86-64-v3");
#else
  return false;
#endif
}

// linear_rows_kernel(x, weight, bias) -> Tensor, or None for a call it does not serve:
// anything ``served`` declines, CPU autocast in force, a dtype other than float32, or a
// weight whose rows are not contiguous.
PyObject* linear_rows_kernel(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (!astrai_set_up()) return nullptr;
  if (n != 3) return fail(PyExc_TypeError, "linear_rows_kernel(x, weight, bias)");
  const at::Tensor* xp = tensor(args[0], "x");
  if (xp == nullptr) return nullptr;
  const at::Tensor* wp = tensor(args[1], "weight");
  if (wp == nullptr) return nullptr;
  const at::Tensor* bp = nullptr;
  if (args[2] != Py_None) {
    bp = tensor(args[2], "bias");
    if (bp == nullptr) return nullptr;
  }
  try {
    if (watched() || !served(args[0], *xp) || !served(args[1], *wp) ||
        (bp != nullptr && !served(args[2], *bp)))
      Py_RETURN_NONE;
    // Under CPU autocast torch's product computes in the lower precision: torch's call.
    if (at::autocast::is_autocast_enabled(at::kCPU)) Py_RETURN_NONE;
    if (xp->scalar_type() != at::kFloat || wp->scalar_type() != at::kFloat ||
        (bp != nullptr && bp->scalar_type() != at::kFloat))
      Py_RETURN_NONE;
    if (xp->dim() < 1 || wp->dim() != 2 || wp->size(1) != xp->size(-1) ||
        (bp != nullptr && (bp->dim() != 1 || bp->size(0) != wp->size(0))))
      return fail(PyExc_ValueError, "linear_rows_kernel: x [..., in], weight [out, in], "
                                    "bias [out] or None");
    const int64_t in = wp->size(1), out = wp->size(0);
    if (in > 1 && wp->stride(1) != 1) Py_RETURN_NONE;  // rows of the weight not contiguous
    std::vector<int64_t> shape(xp->sizes().begin(), xp->sizes().end());
    shape.back() = out;
    int64_t rows = 1;
    for (size_t d = 0; d + 1 < shape.size(); ++d) rows *= shape[d];
    at::Tensor y = at::empty(shape, xp->options());
    at::Tensor x = xp->contiguous();
    at::Tensor bias = bp == nullptr ? at::Tensor() : bp->contiguous();
    if (rows > 0 && out > 0) {
      if (in == 0) {
        if (bias.defined()) y.copy_(bias); else y.zero_();
      } else {
        WithoutGil released;
        linear_rows(x.data_ptr<float>(), wp->data_ptr<float>(), wp->stride(0),
                    bias.defined() ? bias.data_ptr<float>() : nullptr, y.data_ptr<float>(),
                    rows, in, out);
      }
    }
    return THPVariable_Wrap(y);
  } catch (const std::exception& e) {
    return fail(PyExc_RuntimeError, e.what());
  }
}

PyObject* linear_rows_vectorised(PyObject*, PyObject* const*, Py_ssize_t n) {
  if (n != 0) return fail(PyExc_TypeError, "linear_rows_vectorised()");
  return PyBool_FromLong(linear_vectorised());
}

}  // namespace

#define KERNEL(name, doc) \
  {#name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(name)), METH_FASTCALL, doc}

// Added to the native extension's module by its init (astrai/native/hot.cpp).
PyMethodDef astrai_kernel_methods[] = {
    KERNEL(rms_norm_kernel, "rms_norm_kernel(x, weight, eps, weight_offset, cast_before_weight)"
                            " -> Tensor: the reference RMS norm in one pass (CPU)"),
    KERNEL(rotary_half_kernel, "rotary_half_kernel(q, k, cos, sin, unsqueeze_dim) -> (q, k): "
                               "transformers' rotary in one pass (CPU)"),
    KERNEL(linear_rows_kernel, "linear_rows_kernel(x, weight, bias) -> Tensor: x @ weight.T + "
                               "bias for a few rows, float32, the weight read once (CPU)"),
    KERNEL(linear_rows_vectorised, "linear_rows_vectorised() -> bool: whether the linear "
                                   "kernel runs its vector build on this CPU"),
    {nullptr, nullptr, 0, nullptr}};
