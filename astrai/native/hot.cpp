// The facades' hot path, compiled: for a call in the facade's last world, the
// decision the route already took for the call's key, or None.
//
// Each function takes the route's ``last`` list (``astrai.ops._facade.route``) and the
// call's arguments. It answers only a call it can read exactly as the Python path reads
// it - plain tensors (torch.Tensor or nn.Parameter, strided, not nested, no symbolic
// sizes, no __torch_function__ in force) in the common well-formed shapes - and builds
// the very key the route keys that call by: the base values ``describe`` returns, and
// where the table compares one int lazy axis with constants, the index of its interval.
// Any other call, and any change of world, is None: the Python route serves it and
// validates it, raising for a malformed one. Nothing here raises.

#include <Python.h>

#include <ATen/core/grad_mode.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <ATen/PythonTorchFunctionTLS.h>

namespace {

struct Globals {
  PyObject* process = nullptr;   // astrai.dispatch.state's __dict__
  PyObject* snapshot = nullptr;  // "snapshot", interned
  PyObject* scope_var = nullptr; // the scope ContextVar
  PyObject* environ = nullptr;   // os.environ's own dict
  PyObject* ops_key = nullptr;   // ASTR_OPS as that dict stores it
  PyObject* tensor = nullptr;    // torch.Tensor
  PyObject* parameter = nullptr; // torch.nn.Parameter
  PyObject* half = nullptr;      // "half"
  PyObject* dim = nullptr;       // "dim" and "is_floating_point": the methods the Python
  PyObject* floating = nullptr;  // path calls, which an instance attribute could shadow
};
Globals g;

constexpr int kMaxLazy = 5;

// A tensor this file reads as Python would: its exact type is Tensor or Parameter and
// nothing (subclass hook, mode) could make Python read it otherwise.
const at::Tensor* plain(PyObject* obj) {
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(obj));
  if (type != g.tensor && type != g.parameter) return nullptr;
  // The exact types' own __torch_function__ is torch's disabled one: only a mode can
  // step in.
  if (at::impl::torch_function_mode_enabled()) return nullptr;
  PyObject** own = _PyObject_GetDictPtr(obj);
  if (own != nullptr && *own != nullptr && PyDict_GET_SIZE(*own) > 0) {
    if (PyDict_GetItemWithError(*own, g.dim) != nullptr ||
        PyDict_GetItemWithError(*own, g.floating) != nullptr) return nullptr;
    if (PyErr_Occurred()) {
      PyErr_Clear();
      return nullptr;
    }
  }
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.defined() || t.layout() != c10::kStrided || t.is_nested()) return nullptr;
  if (t.unsafeGetTensorImpl()->is_python_dispatch()) return nullptr;
  if (t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return nullptr;
  return &t;
}

// ``dict.get`` of an environment dict: the value (borrowed), Py_None when absent,
// nullptr on error (cleared).
PyObject* env_get(PyObject* key) {
  PyObject* got = PyDict_GetItemWithError(g.environ, key);
  if (got == nullptr) {
    if (PyErr_Occurred()) {
      PyErr_Clear();
      return nullptr;
    }
    return Py_None;
  }
  return got;
}

// ``world.in_force(world)``: the same objects as now, by identity.
bool in_force(PyObject* world) {
  if (!PyTuple_Check(world) || PyTuple_GET_SIZE(world) != 5) return false;
  PyObject* snap = PyDict_GetItemWithError(g.process, g.snapshot);
  if (snap == nullptr) {
    PyErr_Clear();
    return false;
  }
  if (snap != PyTuple_GET_ITEM(world, 0)) return false;
  PyObject* scope = nullptr;
  if (PyContextVar_Get(g.scope_var, nullptr, &scope) < 0) {
    PyErr_Clear();
    return false;
  }
  bool same = scope == PyTuple_GET_ITEM(world, 1);
  Py_XDECREF(scope);
  if (!same) return false;
  if (env_get(g.ops_key) != PyTuple_GET_ITEM(world, 2)) return false;
  PyObject* alias_key = PyTuple_GET_ITEM(world, 3);
  if (alias_key != Py_None && env_get(alias_key) != PyTuple_GET_ITEM(world, 4)) return false;
  return true;
}

// The route's last world, if it is in force: (world, decisions, keyer, hot). nullptr
// otherwise.
PyObject* seen_in_force(PyObject* last) {
  if (!PyList_Check(last) || PyList_GET_SIZE(last) != 1) return nullptr;
  PyObject* seen = PyList_GET_ITEM(last, 0);
  if (!PyTuple_Check(seen) || PyTuple_GET_SIZE(seen) != 4) return nullptr;
  if (!PyDict_Check(PyTuple_GET_ITEM(seen, 1))) return nullptr;
  if (!in_force(PyTuple_GET_ITEM(seen, 0))) return nullptr;
  return seen;
}

// The key of a call whose base values are ``base`` (``n`` new references, stolen) and
// whose hot-readable lazy axes are ``lazy``, looked up in ``seen``'s decisions: the
// decision (a new reference) or None.
PyObject* answer(PyObject* seen, PyObject** base, int n, const int64_t* lazy, int nlazy) {
  PyObject* hot = PyTuple_GET_ITEM(seen, 3);
  int64_t index = -1;
  for (int i = 0; i < n; ++i) {
    if (base[i] == nullptr) {  // out of memory making a value
      PyErr_Clear();
      goto decline;
    }
  }
  if (hot != Py_None) {
    // (code, points): the interval of lazy axis ``code`` between the sorted cut points.
    if (!PyTuple_Check(hot) || PyTuple_GET_SIZE(hot) != 2) goto decline;
    {
      long code = PyLong_AsLong(PyTuple_GET_ITEM(hot, 0));
      PyObject* points = PyTuple_GET_ITEM(hot, 1);
      if (code < 0 || code >= nlazy || !PyTuple_Check(points)) {
        PyErr_Clear();
        goto decline;
      }
      int64_t value = lazy[code];
      if (value < 0) goto decline;  // not read exactly (rows)
      index = 0;
      for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(points); ++i) {
        long long point = PyLong_AsLongLong(PyTuple_GET_ITEM(points, i));
        if (point == -1 && PyErr_Occurred()) {
          PyErr_Clear();
          goto decline;
        }
        if (point <= value) index = i + 1;
        else break;
      }
    }
  }
  {
    PyObject* key = PyTuple_New(n + (index >= 0 ? 1 : 0));
    if (key == nullptr) goto decline;
    for (int i = 0; i < n; ++i) PyTuple_SET_ITEM(key, i, base[i]);
    if (index >= 0) {
      PyObject* i = PyLong_FromLongLong(index);
      if (i == nullptr) {
        PyErr_Clear();
        Py_DECREF(key);
        Py_RETURN_NONE;
      }
      PyTuple_SET_ITEM(key, n, i);
    }
    PyObject* d = PyDict_GetItemWithError(PyTuple_GET_ITEM(seen, 1), key);
    Py_DECREF(key);
    if (d == nullptr) {
      PyErr_Clear();
      Py_RETURN_NONE;
    }
    Py_INCREF(d);
    return d;
  }
decline:
  for (int i = 0; i < n; ++i) Py_XDECREF(base[i]);
  Py_RETURN_NONE;
}

PyObject* new_bool(bool b) {
  PyObject* o = b ? Py_True : Py_False;
  Py_INCREF(o);
  return o;
}

PyObject* new_dtype(const at::Tensor& t) {
  PyObject* o = reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()));
  Py_INCREF(o);
  return o;
}

// The base values most families begin with, for the call's main tensor ``t``: dtype,
// device_cuda, ndim, grad_enabled (four new references into ``base``).
void tensor_base(PyObject** base, const at::Tensor& t) {
  base[0] = new_dtype(t);
  base[1] = new_bool(t.is_cuda());
  base[2] = PyLong_FromSsize_t(static_cast<Py_ssize_t>(t.dim()));
  base[3] = new_bool(at::GradMode::is_enabled());
}

// The product of ``s`` but its last ``features`` sizes, or -1 when it does not fit in 64
// bits (a tensor with a zero size may have such sizes; Python's product is exact, so the
// call is declined).
int64_t rows(c10::IntArrayRef s, size_t features) {
  int64_t p = 1;
  for (size_t i = 0; i + features < s.size(); ++i) {
    if (__builtin_mul_overflow(p, s[i], &p)) return -1;
  }
  return p;
}

#define HOT_BEGIN(nargs)                                   \
  if (n != (nargs)) Py_RETURN_NONE;                        \
  try {                                                    \
    PyObject* seen = seen_in_force(args[0]);               \
    if (seen == nullptr) Py_RETURN_NONE;

#define HOT_END                                            \
  } catch (...) {                                          \
    PyErr_Clear();                                         \
  }                                                        \
  Py_RETURN_NONE;

// rms_norm(last, x, weight, eps[, weight_offset, cast_before_weight]): x [..., f], weight
// [f], eps a float >= 0; the two booleans, when given, say which of the forms the call
// asks for (the feature axes ``describe_rms_norm`` appends when either is asked; the
// caller checked the forms' values).
PyObject* rms_norm(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n == 6 && !(PyBool_Check(args[4]) && PyBool_Check(args[5]))) Py_RETURN_NONE;
  // Neither form: the plain call's key, without feature axes (as ``describe`` gives it).
  bool forms = n == 6 && (args[4] == Py_True || args[5] == Py_True);
  HOT_BEGIN(n == 6 ? 6 : 4)
  const at::Tensor* x = plain(args[1]);
  const at::Tensor* w = x ? plain(args[2]) : nullptr;
  if (w == nullptr || !PyFloat_CheckExact(args[3]) || !(PyFloat_AS_DOUBLE(args[3]) >= 0))
    Py_RETURN_NONE;
  auto xs = x->sizes();
  auto ws = w->sizes();
  if (ws.size() != 1 || xs.empty() || ws[0] != xs.back()) Py_RETURN_NONE;
  int64_t lazy[] = {rows(xs, 1)};  // tokens
  PyObject* base[6];
  tensor_base(base, *x);
  if (forms) {
    Py_INCREF(args[4]);
    Py_INCREF(args[5]);
    base[4] = args[4];
    base[5] = args[5];
  }
  return answer(seen, base, forms ? 6 : 4, lazy, 1);
  HOT_END
}

// linear(last, x, weight, bias): x [..., in], weight [out, in], bias [out] or None, one dtype.
PyObject* linear(PyObject*, PyObject* const* args, Py_ssize_t n) {
  HOT_BEGIN(4)
  const at::Tensor* x = plain(args[1]);
  const at::Tensor* w = x ? plain(args[2]) : nullptr;
  if (w == nullptr) Py_RETURN_NONE;
  auto xs = x->sizes();
  auto ws = w->sizes();
  if (ws.size() != 2 || xs.empty() || ws[1] != xs.back() || w->scalar_type() != x->scalar_type())
    Py_RETURN_NONE;
  if (args[3] != Py_None) {
    const at::Tensor* b = plain(args[3]);
    if (b == nullptr || b->dim() != 1 || b->sizes()[0] != ws[0] ||
        b->scalar_type() != x->scalar_type())
      Py_RETURN_NONE;
  }
  PyObject* base[4];
  tensor_base(base, *x);
  int64_t lazy[] = {rows(xs, 1), ws[1], ws[0]};  // tokens, in_features, out_features
  return answer(seen, base, 4, lazy, 3);
  HOT_END
}

// rotary(last, x, freqs_cis): adjacent pairs; x [b, s, h, d] with freqs [b or 1, s, d/2, 2]
// or [s, d/2, 2], or packed x [t, h, d] with freqs [t, d/2, 2]; d even, freqs floating.
PyObject* rotary(PyObject*, PyObject* const* args, Py_ssize_t n) {
  HOT_BEGIN(3)
  const at::Tensor* x = plain(args[1]);
  const at::Tensor* f = x ? plain(args[2]) : nullptr;
  if (f == nullptr) Py_RETURN_NONE;
  auto xs = x->sizes();
  auto ts = f->sizes();
  size_t nd = xs.size();
  bool fits;
  if (nd == 4) {
    fits = (ts.size() == 4 && ts[1] == xs[1] && (ts[0] == 1 || ts[0] == xs[0])) ||
           (ts.size() == 3 && ts[0] == xs[1]);
  } else {
    fits = nd == 3 && ts.size() == 3 && ts[0] == xs[0];
  }
  if (!fits) Py_RETURN_NONE;
  int64_t d = xs.back();
  if (d < 2 || d % 2 != 0 || ts[ts.size() - 2] != d / 2 || ts.back() != 2 ||
      !f->is_floating_point())
    Py_RETURN_NONE;
  PyObject* base[] = {new_dtype(*x), new_bool(x->is_cuda()),
                      PyLong_FromSsize_t(static_cast<Py_ssize_t>(nd)), PyLong_FromLongLong(d),
                      new_bool(at::GradMode::is_enabled())};
  int64_t lazy[] = {rows(xs, 2), xs[nd - 2]};  // tokens, heads
  return answer(seen, base, 5, lazy, 2);
  HOT_END
}

// rotary_half(last, q, k, cos, sin, unsqueeze_dim): q, k [b, h, s, d] (k's heads may
// differ), cos = sin [b or 1, s, d], d even, q and k of one dtype, unsqueeze_dim 1.
PyObject* rotary_half(PyObject*, PyObject* const* args, Py_ssize_t n) {
  HOT_BEGIN(6)
  if (!PyLong_CheckExact(args[5]) || PyLong_AsLong(args[5]) != 1) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  const at::Tensor* q = plain(args[1]);
  const at::Tensor* k = q ? plain(args[2]) : nullptr;
  const at::Tensor* c = k ? plain(args[3]) : nullptr;
  const at::Tensor* s = c ? plain(args[4]) : nullptr;
  if (s == nullptr) Py_RETURN_NONE;
  auto qs = q->sizes();
  auto ks = k->sizes();
  auto cs = c->sizes();
  if (qs.size() != 4 || ks.size() != 4 || cs.size() != 3 || s->sizes() != cs) Py_RETURN_NONE;
  int64_t b = qs[0], seq = qs[2], d = qs[3];
  if (qs[1] == 0 ||  // Python's tokens reader divides by the heads
      ks[0] != b || ks[2] != seq || ks[3] != d || cs[2] != d || cs[1] != seq ||
      !(cs[0] == b || cs[0] == 1) || d < 2 || d % 2 != 0 ||
      k->scalar_type() != q->scalar_type() || !c->is_floating_point() ||
      !s->is_floating_point())
    Py_RETURN_NONE;
  Py_INCREF(g.half);
  PyObject* base[] = {new_dtype(*q), new_bool(q->is_cuda()), PyLong_FromLong(4),
                      PyLong_FromLongLong(d), new_bool(at::GradMode::is_enabled()), g.half};
  int64_t tokens;
  if (__builtin_mul_overflow(b, seq, &tokens)) tokens = -1;
  int64_t lazy[] = {tokens, qs[1]};  // tokens, heads
  return answer(seen, base, 6, lazy, 2);
  HOT_END
}

// attention(last, q, k, v, kv_cache, attn_mask, fwd): the dense call without a cache, a
// mask or fwd; q [b, s, h, d], k = v [b, skv, kh, d] (kh > 0 dividing h), one dtype.
PyObject* attention(PyObject*, PyObject* const* args, Py_ssize_t n) {
  HOT_BEGIN(7)
  if (args[4] != Py_None || args[5] != Py_None || args[6] != Py_None) Py_RETURN_NONE;
  const at::Tensor* q = plain(args[1]);
  const at::Tensor* k = q ? plain(args[2]) : nullptr;
  const at::Tensor* v = k ? plain(args[3]) : nullptr;
  if (v == nullptr) Py_RETURN_NONE;
  auto qs = q->sizes();
  auto ks = k->sizes();
  if (qs.size() != 4 || ks.size() != 4 || v->sizes() != ks) Py_RETURN_NONE;
  int64_t d = qs[3], h = qs[2], kh = ks[2];
  if (qs[0] != ks[0] || d != ks[3] || d <= 0 || kh <= 0 || h % kh != 0 ||
      k->scalar_type() != q->scalar_type() || v->scalar_type() != q->scalar_type())
    Py_RETURN_NONE;
  Py_INCREF(Py_None);
  PyObject* base[] = {Py_None, new_dtype(*q), new_bool(q->is_cuda()), PyLong_FromLong(4),
                      PyLong_FromLongLong(d), new_bool(false), new_bool(false),
                      new_bool(at::GradMode::is_enabled())};
  int64_t lazy[] = {qs[0], qs[1], ks[1], h, kh};  // batch, q_len, kv_len, heads, kv_heads
  return answer(seen, base, 8, lazy, kMaxLazy);
  HOT_END
}

// call(last, t): ``ops.call`` of a family without a context builder whose first
// argument is ``t``: key (dtype, device_cuda, ndim, grad_enabled); no lazy axis.
PyObject* call(PyObject*, PyObject* const* args, Py_ssize_t n) {
  HOT_BEGIN(2)
  if (PyTuple_GET_ITEM(seen, 3) != Py_None) Py_RETURN_NONE;
  const at::Tensor* t = plain(args[1]);
  if (t == nullptr) Py_RETURN_NONE;
  PyObject* base[4];
  tensor_base(base, *t);
  return answer(seen, base, 4, nullptr, 0);
  HOT_END
}

// setup(process_dict, scope_var, environ_data, ops_key, tensor, parameter)
PyObject* setup(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 6 || !PyDict_Check(args[0]) || !PyDict_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError, "setup(process_dict, scope_var, environ_data, ops_key, "
                                     "tensor, parameter)");
    return nullptr;
  }
  PyObject** slots[] = {&g.process, &g.scope_var, &g.environ, &g.ops_key, &g.tensor,
                        &g.parameter};
  for (int i = 0; i < 6; ++i) {
    Py_INCREF(args[i]);
    Py_XSETREF(*slots[i], args[i]);
  }
  if (g.snapshot == nullptr) g.snapshot = PyUnicode_InternFromString("snapshot");
  if (g.half == nullptr) g.half = PyUnicode_InternFromString("half");
  if (g.dim == nullptr) g.dim = PyUnicode_InternFromString("dim");
  if (g.floating == nullptr) g.floating = PyUnicode_InternFromString("is_floating_point");
  if (g.snapshot == nullptr || g.half == nullptr || g.dim == nullptr || g.floating == nullptr)
    return nullptr;
  Py_RETURN_NONE;
}

#define METHOD(name, doc) \
  {#name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(name)), METH_FASTCALL, doc}

PyMethodDef methods[] = {
    METHOD(setup, "Bind the process state, scope variable, environment and tensor types."),
    METHOD(rms_norm, "rms_norm(last, x, weight, eps[, weight_offset, cast_before_weight]) "
                     "-> Decision | None"),
    METHOD(linear, "linear(last, x, weight, bias) -> Decision | None"),
    METHOD(rotary, "rotary(last, x, freqs_cis) -> Decision | None"),
    METHOD(rotary_half, "rotary_half(last, q, k, cos, sin, unsqueeze_dim) -> Decision | None"),
    METHOD(attention, "attention(last, q, k, v, kv_cache, attn_mask, fwd) -> Decision | None"),
    METHOD(call, "call(last, t) -> Decision | None"),
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_astrai_hot",
                      "astrai's native extension: the facades' hot path and the native rows' "
                      "CPU kernels (astrai.native).",
                      -1, methods};

}  // namespace

// ``plain`` for the native rows' kernels (astrai/native/kernels.cpp): whether ``obj``
// is a tensor this file reads as Python would.
bool astrai_plain_tensor(PyObject* obj) { return plain(obj) != nullptr; }

// The native rows' CPU kernels (astrai/native/kernels.cpp), linked into this module.
extern PyMethodDef astrai_kernel_methods[];

PyMODINIT_FUNC PyInit__astrai_hot(void) {
  PyObject* m = PyModule_Create(&module);
  if (m != nullptr && PyModule_AddFunctions(m, astrai_kernel_methods) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
