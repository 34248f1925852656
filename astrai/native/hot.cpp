// The facades' hot path, compiled: for a call in the facade's last world, the decision
// the route already took for the call's key, or None.
//
// It knows no family. A facade's route hands it, with its last world, a *plan*: the
// family's reading of its common calls (``astrai.dispatch.reading``: guards, base values,
// lazy values, as opcodes) and the key layout the snapshot's specs ask for (intervals of
// lazy axes between cut points, raw lazy values, signs of compared pairs). ``lookup``
// runs that data on a call: it answers only a call it reads exactly as the Python path
// reads it - plain tensors (torch.Tensor or nn.Parameter, strided, not nested, no
// symbolic sizes, no __torch_function__ in force) passing one case's guards - builds the
// very key the route keys that call by, and looks it up in the last world's decisions.
// Any other call, and any change of world, is None: the Python route serves it and
// validates it, raising for a malformed one. Nothing here raises, but a call of a module
// never set up, which is a RuntimeError.
//
// Every Python object read across a point where Python code may run (a tensor's
// attribute lookup, an allocation that starts a garbage collection, a finalizer that
// switches threads) is held by a strong reference for as long as it is read.

#include <Python.h>

#include <ATen/core/grad_mode.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <new>
#include <vector>

bool astrai_set_up();

namespace {

struct Globals {
  PyObject* process = nullptr;   // astrai.dispatch.state's __dict__
  PyObject* snapshot = nullptr;  // "snapshot", interned
  PyObject* scope_var = nullptr; // the scope ContextVar
  PyObject* environ = nullptr;   // os.environ's own dict
  PyObject* ops_key = nullptr;   // ASTR_OPS as that dict stores it
  PyObject* tensor = nullptr;    // torch.Tensor
  PyObject* parameter = nullptr; // torch.nn.Parameter
  PyObject* cpu = nullptr;       // "cpu", interned: the common device type
};
Globals g;

bool ready() { return g.process != nullptr; }
// Whether the tensor types are bound (tensor_types or setup): all the kernels need.
bool typed() { return g.tensor != nullptr && g.parameter != nullptr; }

// The most arguments, base values and lazy slots a plan may have.
constexpr int kMax = 16;

// A strong reference, released when it goes out of scope.
struct Ref {
  PyObject* o = nullptr;
  Ref() = default;
  explicit Ref(PyObject* borrowed) : o(borrowed) { Py_XINCREF(o); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  ~Ref() { Py_XDECREF(o); }
};

// A tensor this file reads as Python would: its exact type is Tensor or Parameter and
// nothing (subclass hook, mode) could make Python read it otherwise. (The Python readings
// use only attributes an instance cannot shadow: shape, dtype, is_cuda, device.)
const at::Tensor* plain(PyObject* obj) {
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(obj));
  if (type != g.tensor && type != g.parameter) return nullptr;
  // The exact types' own __torch_function__ is torch's disabled one: only a mode can
  // step in.
  if (at::impl::torch_function_mode_enabled()) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.defined() || t.layout() != c10::kStrided || t.is_nested()) return nullptr;
  if (t.unsafeGetTensorImpl()->is_python_dispatch()) return nullptr;
  if (t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return nullptr;
  return &t;
}

// Whether autocast is in force for any device: a call is then cast by its facade before
// it is decided (its operands' dtypes are not the ones it was called with), so no kept
// decision answers it. Autocast is in force for a device when its key is not excluded.
bool autocasting() {
  return !c10::impl::tls_local_dispatch_key_set().excluded_.isSupersetOf(
      c10::autocast_dispatch_keyset);
}

// ``dict.get`` of an environment dict: the value (borrowed, compared by identity only),
// Py_None when absent, nullptr on error (cleared).
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

// ``world.in_force(world)``: the same objects as now, by identity. ``world`` is held by
// the caller.
bool in_force(PyObject* world) {
  if (!PyTuple_Check(world) || PyTuple_GET_SIZE(world) < 5) return false;
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

// -- plans ----------------------------------------------------------------------------

// Opcodes, in the order of astrai.dispatch.reading's GUARDS and VALUES.
enum Guard {
  G_TENSOR, G_TENSOR_OR_NONE, G_IS, G_FLOAT_GE0, G_INT_EQ, G_BOOL, G_NDIM, G_NDIM_GE,
  G_SIZE_EQ, G_SIZE_IS, G_SIZE_GE, G_SIZE_EVEN, G_SIZE_DIV, G_SIZE_TWICE, G_SHAPE_EQ,
  G_DTYPE_EQ, G_FLOATING, G_ANY, G_FLOAT, G_FLOAT_GT0, G_COUNT
};
enum Value {
  V_DTYPE, V_CUDA, V_NDIM, V_SIZE, V_GRAD, V_CONST, V_ARG, V_ROWS, V_PROD, V_DEVICE,
  V_SM, V_COUNT
};
enum Item { I_INTERVAL, I_RAW, I_SIGN };

struct Op {
  int code = 0;
  int64_t x[4] = {0, 0, 0, 0};
  std::vector<std::vector<Op>> groups;  // G_ANY
};

struct Case {
  std::vector<Op> guards;
  std::vector<Op> base;
  std::vector<Op> lazy;  // one per lazy slot; code -1 where this case cannot read it
};

struct KeyItem {
  int kind = 0;
  int slot = 0;                 // I_INTERVAL, I_RAW: the lazy slot
  std::vector<int64_t> points;  // I_INTERVAL
  int side[2][2] = {{0, 0}, {0, 0}};  // I_SIGN: (0 lazy / 1 base, index) per side
};

struct Plan {
  int arity = 0;
  std::vector<Case> cases;
  std::vector<PyObject*> consts;  // owned
  std::vector<KeyItem> items;
  int slots = 0;
  ~Plan() {
    for (PyObject* c : consts) Py_XDECREF(c);
  }
};

constexpr const char* kCapsule = "astrai.native.plan";

void drop_plan(PyObject* capsule) {
  delete static_cast<Plan*>(PyCapsule_GetPointer(capsule, kCapsule));
}

// Parsing a plan: a ``ValueError`` naming what is wrong (the plan comes from Python code
// of astrai's, so this is a bug report, not a user error).
struct BadPlan {
  const char* what;
};

int64_t as_int(PyObject* o) {
  long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    throw BadPlan{"an operand is not an int"};
  }
  return static_cast<int64_t>(v);
}

PyObject* item(PyObject* seq, Py_ssize_t i) {
  if (!PyTuple_Check(seq) || i >= PyTuple_GET_SIZE(seq)) throw BadPlan{"a tuple is too short"};
  return PyTuple_GET_ITEM(seq, i);
}

Py_ssize_t length(PyObject* seq) {
  if (!PyTuple_Check(seq)) throw BadPlan{"a tuple was expected"};
  return PyTuple_GET_SIZE(seq);
}

Op parse_op(PyObject* t, bool guard, int arity, size_t nconsts);

std::vector<Op> parse_ops(PyObject* seq, bool guard, int arity, size_t nconsts) {
  std::vector<Op> out;
  for (Py_ssize_t i = 0; i < length(seq); ++i)
    out.push_back(parse_op(item(seq, i), guard, arity, nconsts));
  return out;
}

Op parse_op(PyObject* t, bool guard, int arity, size_t nconsts) {
  Op op;
  op.code = static_cast<int>(as_int(item(t, 0)));
  int count = guard ? static_cast<int>(G_COUNT) : static_cast<int>(V_COUNT);
  if (op.code < 0 || op.code >= count) throw BadPlan{"unknown opcode"};
  if (guard && op.code == G_ANY) {
    for (Py_ssize_t i = 1; i < length(t); ++i)
      op.groups.push_back(parse_ops(item(t, i), true, arity, nconsts));
    return op;
  }
  Py_ssize_t n = length(t) - 1;
  if (n > 4) throw BadPlan{"too many operands"};
  for (Py_ssize_t i = 0; i < n; ++i) op.x[i] = as_int(item(t, i + 1));
  // Argument operands in range, constants known.
  bool no_arg = !guard && (op.code == V_GRAD || op.code == V_CONST);
  if (!no_arg && (n < 1 || op.x[0] < 0 || op.x[0] >= arity)) throw BadPlan{"argument index"};
  if (guard && op.code == G_IS && (n < 2 || op.x[1] < 0 || static_cast<size_t>(op.x[1]) >= nconsts))
    throw BadPlan{"constant index"};
  if (!guard && op.code == V_CONST && (n < 1 || op.x[0] < 0 || static_cast<size_t>(op.x[0]) >= nconsts))
    throw BadPlan{"constant index"};
  bool pair = guard ? (op.code == G_SIZE_EQ || op.code == G_SIZE_DIV || op.code == G_SIZE_TWICE)
                    : op.code == V_PROD;
  if (pair && (n < 4 || op.x[2] < 0 || op.x[2] >= arity)) throw BadPlan{"argument index"};
  if (guard && op.code == G_SHAPE_EQ && (n < 2 || op.x[1] < 0 || op.x[1] >= arity))
    throw BadPlan{"argument index"};
  if (guard && op.code == G_DTYPE_EQ && (n < 2 || op.x[1] < 0 || op.x[1] >= arity))
    throw BadPlan{"argument index"};
  return op;
}

// plan(arity, cases, consts, items, slots) -> capsule; see astrai.dispatch.reading.encode.
PyObject* make_plan(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 5) {
    PyErr_SetString(PyExc_TypeError, "plan(arity, cases, consts, items, slots)");
    return nullptr;
  }
  std::unique_ptr<Plan> plan(new (std::nothrow) Plan());
  if (!plan) return PyErr_NoMemory();
  try {
    plan->arity = static_cast<int>(as_int(args[0]));
    plan->slots = static_cast<int>(as_int(args[4]));
    if (plan->arity < 0 || plan->arity > kMax || plan->slots < 0 || plan->slots > kMax)
      throw BadPlan{"arity or slots out of range"};
    for (Py_ssize_t i = 0; i < length(args[2]); ++i) {
      PyObject* c = item(args[2], i);
      Py_INCREF(c);
      plan->consts.push_back(c);
    }
    size_t nconsts = plan->consts.size();
    for (Py_ssize_t i = 0; i < length(args[1]); ++i) {
      PyObject* c = item(args[1], i);
      Case one;
      one.guards = parse_ops(item(c, 0), true, plan->arity, nconsts);
      one.base = parse_ops(item(c, 1), false, plan->arity, nconsts);
      if (one.base.size() > static_cast<size_t>(kMax)) throw BadPlan{"too many base values"};
      PyObject* lazy = item(c, 2);
      if (length(lazy) != plan->slots) throw BadPlan{"a case's lazy values are not one per slot"};
      for (Py_ssize_t j = 0; j < plan->slots; ++j) {
        PyObject* v = item(lazy, j);
        if (v == Py_None) {
          Op none;
          none.code = -1;
          one.lazy.push_back(none);
        } else {
          one.lazy.push_back(parse_op(v, false, plan->arity, nconsts));
        }
      }
      plan->cases.push_back(std::move(one));
    }
    for (Py_ssize_t i = 0; i < length(args[3]); ++i) {
      PyObject* it = item(args[3], i);
      KeyItem k;
      k.kind = static_cast<int>(as_int(item(it, 0)));
      if (k.kind == I_INTERVAL || k.kind == I_RAW) {
        k.slot = static_cast<int>(as_int(item(it, 1)));
        if (k.slot < 0 || k.slot >= plan->slots) throw BadPlan{"slot index"};
        if (k.kind == I_INTERVAL) {
          PyObject* pts = item(it, 2);
          for (Py_ssize_t j = 0; j < length(pts); ++j) k.points.push_back(as_int(item(pts, j)));
        }
      } else if (k.kind == I_SIGN) {
        for (int s = 0; s < 2; ++s) {
          k.side[s][0] = static_cast<int>(as_int(item(it, 1 + 2 * s)));
          k.side[s][1] = static_cast<int>(as_int(item(it, 2 + 2 * s)));
          if (k.side[s][0] == 0 && (k.side[s][1] < 0 || k.side[s][1] >= plan->slots))
            throw BadPlan{"slot index"};
          if (k.side[s][0] != 0 && (k.side[s][0] != 1 || k.side[s][1] < 0))
            throw BadPlan{"base index"};
        }
      } else {
        throw BadPlan{"unknown key item"};
      }
      plan->items.push_back(std::move(k));
    }
  } catch (const BadPlan& bad) {
    PyErr_Format(PyExc_ValueError, "astrai native plan: %s", bad.what);
    return nullptr;
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  }
  PyObject* capsule = PyCapsule_New(plan.get(), kCapsule, drop_plan);
  if (capsule != nullptr) plan.release();
  return capsule;
}

// -- running a plan on a call ----------------------------------------------------------

struct Call {
  PyObject* const* args;
  int arity;
  const at::Tensor* t[kMax];
  bool looked[kMax];
  const at::Tensor* tensor(int64_t i) {
    if (!looked[i]) {
      looked[i] = true;
      t[i] = args[i] == Py_None ? nullptr : plain(args[i]);
    }
    return t[i];
  }
};

// Size ``a`` (negative from the end) of ``t``, or -1 out of range.
int64_t size_of(const at::Tensor* t, int64_t a) {
  int64_t n = t->dim();
  if (a < 0) a += n;
  if (a < 0 || a >= n) return -1;
  return t->sizes()[a];
}

bool mul(int64_t a, int64_t b, int64_t* out) {
  if (a < 0 || b < 0) return false;
  if (a != 0 && b > std::numeric_limits<int64_t>::max() / a) return false;
  *out = a * b;
  return true;
}

bool guard(const Op& op, Call& c, const Plan& plan) {
  if (op.code == G_ANY) {
    for (const auto& group : op.groups) {
      bool all = true;
      for (const Op& g2 : group) {
        if (!guard(g2, c, plan)) {
          all = false;
          break;
        }
      }
      if (all) return true;
    }
    return false;
  }
  PyObject* x = c.args[op.x[0]];
  switch (op.code) {
    case G_TENSOR: return x != Py_None && c.tensor(op.x[0]) != nullptr;
    case G_TENSOR_OR_NONE: return x == Py_None || c.tensor(op.x[0]) != nullptr;
    case G_IS: return x == plan.consts[op.x[1]];
    case G_FLOAT_GE0: return PyFloat_CheckExact(x) && PyFloat_AS_DOUBLE(x) >= 0;
    case G_FLOAT: return PyFloat_CheckExact(x);
    case G_FLOAT_GT0: return PyFloat_CheckExact(x) && PyFloat_AS_DOUBLE(x) > 0;
    case G_INT_EQ: {
      if (!PyLong_CheckExact(x)) return false;
      int overflow = 0;
      long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
      if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return false;
      }
      return overflow == 0 && v == op.x[1];
    }
    case G_BOOL: return PyBool_Check(x);
    default: break;
  }
  const at::Tensor* t = c.tensor(op.x[0]);
  if (t == nullptr) return false;
  switch (op.code) {
    case G_NDIM: return t->dim() == op.x[1];
    case G_NDIM_GE: return t->dim() >= op.x[1];
    case G_SIZE_EQ: {
      const at::Tensor* u = c.tensor(op.x[2]);
      if (u == nullptr) return false;
      int64_t a = size_of(t, op.x[1]);
      return a >= 0 && a == size_of(u, op.x[3]);
    }
    case G_SIZE_IS: return size_of(t, op.x[1]) == op.x[2] && op.x[2] >= 0;
    case G_SIZE_GE: {
      int64_t a = size_of(t, op.x[1]);
      return a >= 0 && a >= op.x[2];
    }
    case G_SIZE_EVEN: {
      int64_t a = size_of(t, op.x[1]);
      return a >= 0 && a % 2 == 0;
    }
    case G_SIZE_DIV: {
      const at::Tensor* u = c.tensor(op.x[2]);
      if (u == nullptr) return false;
      int64_t a = size_of(t, op.x[1]), b = size_of(u, op.x[3]);
      return a >= 0 && b > 0 && a % b == 0;
    }
    case G_SIZE_TWICE: {
      const at::Tensor* u = c.tensor(op.x[2]);
      if (u == nullptr) return false;
      int64_t a = size_of(t, op.x[1]), b = size_of(u, op.x[3]);
      return a >= 0 && b >= 0 && b <= std::numeric_limits<int64_t>::max() / 2 && a == 2 * b;
    }
    case G_SHAPE_EQ: {
      const at::Tensor* u = c.tensor(op.x[1]);
      return u != nullptr && t->sizes() == u->sizes();
    }
    case G_DTYPE_EQ: {
      const at::Tensor* u = c.tensor(op.x[1]);
      return u != nullptr && t->scalar_type() == u->scalar_type();
    }
    case G_FLOATING: return t->is_floating_point();
    default: return false;
  }
}

// A value read off a call: an int (``is_int``) or a new reference.
struct Val {
  bool ok = false;
  bool is_int = false;
  int64_t i = 0;
  PyObject* o = nullptr;  // new reference when !is_int
};

PyObject* new_bool(bool b) {
  PyObject* o = b ? Py_True : Py_False;
  Py_INCREF(o);
  return o;
}

Val value(const Op& op, Call& c, const Plan& plan) {
  Val v;
  switch (op.code) {
    case V_GRAD:
      v.o = new_bool(at::GradMode::is_enabled());
      v.ok = true;
      return v;
    case V_CONST:
      v.o = plan.consts[op.x[0]];
      Py_INCREF(v.o);
      v.ok = true;
      return v;
    case V_ARG:
      v.o = c.args[op.x[0]];
      Py_INCREF(v.o);
      v.ok = true;
      return v;
    default: break;
  }
  const at::Tensor* t = c.tensor(op.x[0]);
  if (t == nullptr) return v;
  switch (op.code) {
    case V_DTYPE:
      v.o = reinterpret_cast<PyObject*>(torch::getTHPDtype(t->scalar_type()));
      Py_INCREF(v.o);
      break;
    case V_CUDA: v.o = new_bool(t->is_cuda()); break;
    case V_NDIM:
      v.is_int = true;
      v.i = t->dim();
      break;
    case V_SIZE:
      v.is_int = true;
      v.i = size_of(t, op.x[1]);
      if (v.i < 0) return v;
      break;
    case V_ROWS: {
      auto s = t->sizes();
      int64_t p = 1;
      for (int64_t k = 0; k + op.x[1] < static_cast<int64_t>(s.size()); ++k)
        if (!mul(p, s[k], &p)) return v;  // beyond 64 bits: Python's product is exact
      v.is_int = true;
      v.i = p;
      break;
    }
    case V_PROD: {
      const at::Tensor* u = c.tensor(op.x[2]);
      if (u == nullptr) return v;
      int64_t a = size_of(t, op.x[1]), b = size_of(u, op.x[3]), p = 0;
      if (a < 0 || b < 0 || !mul(a, b, &p)) return v;
      v.is_int = true;
      v.i = p;
      break;
    }
    case V_DEVICE:
      if (t->device().is_cpu()) {
        v.o = g.cpu;
        Py_INCREF(v.o);
      } else {
        v.o = PyUnicode_FromString(c10::DeviceTypeName(t->device().type(), true).c_str());
        if (v.o == nullptr) {
          PyErr_Clear();
          return v;
        }
      }
      break;
    case V_SM:  // None off CUDA; a capability is Python's to read
      if (t->is_cuda()) return v;
      v.o = Py_None;
      Py_INCREF(v.o);
      break;
    default: return v;
  }
  v.ok = true;
  return v;
}

PyObject* as_object(Val& v) {  // steals v.o
  if (!v.is_int) {
    PyObject* o = v.o;
    v.o = nullptr;
    return o;
  }
  PyObject* o = PyLong_FromLongLong(v.i);
  if (o == nullptr) PyErr_Clear();
  return o;
}

// The key of a call read by ``c`` (a new reference), or nullptr to decline.
PyObject* key_of(const Plan& plan, const Case& cs, Call& c) {
  size_t nbase = cs.base.size();
  Ref key;
  key.o = PyTuple_New(static_cast<Py_ssize_t>(nbase + plan.items.size()));
  if (key.o == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  // The base values as ints where they are (for a compared pair), and into the key. No
  // allocation but the key's own: a plan holds at most kMax of each.
  if (nbase > static_cast<size_t>(kMax)) return nullptr;
  bool base_is_int[kMax];
  int64_t base_int[kMax];
  for (size_t i = 0; i < nbase; ++i) {
    Val v = value(cs.base[i], c, plan);
    if (!v.ok) return nullptr;
    base_is_int[i] = v.is_int;
    base_int[i] = v.i;
    if (!v.is_int && PyLong_CheckExact(v.o)) {
      long long x = PyLong_AsLongLong(v.o);
      if (!(x == -1 && PyErr_Occurred())) {
        base_is_int[i] = true;
        base_int[i] = static_cast<int64_t>(x);
      }
      PyErr_Clear();
    }
    PyObject* o = as_object(v);
    if (o == nullptr) return nullptr;
    PyTuple_SET_ITEM(key.o, static_cast<Py_ssize_t>(i), o);
  }
  Val lazy[kMax];
  struct Release {
    Val* vals;
    int n;
    ~Release() {
      for (int i = 0; i < n; ++i) Py_XDECREF(vals[i].o);
    }
  } release{lazy, plan.slots};
  for (int s = 0; s < plan.slots; ++s) {
    if (cs.lazy[s].code < 0) return nullptr;  // a lazy axis this case cannot read
    lazy[s] = value(cs.lazy[s], c, plan);
    if (!lazy[s].ok) return nullptr;
  }
  for (size_t k = 0; k < plan.items.size(); ++k) {
    const KeyItem& it = plan.items[k];
    PyObject* o = nullptr;
    if (it.kind == I_INTERVAL) {
      Val& v = lazy[it.slot];
      if (!v.is_int) return nullptr;
      int64_t index = 0;
      for (size_t p = 0; p < it.points.size(); ++p) {
        if (it.points[p] <= v.i) index = static_cast<int64_t>(p) + 1;
        else break;
      }
      o = PyLong_FromLongLong(index);
    } else if (it.kind == I_RAW) {
      Val& v = lazy[it.slot];
      if (v.is_int) {
        o = PyLong_FromLongLong(v.i);
      } else {
        o = v.o;
        Py_INCREF(o);
      }
    } else {
      int64_t side[2];
      for (int s = 0; s < 2; ++s) {
        int where = it.side[s][0], idx = it.side[s][1];
        if (where == 0) {
          if (!lazy[idx].is_int) return nullptr;
          side[s] = lazy[idx].i;
        } else {
          if (static_cast<size_t>(idx) >= nbase || !base_is_int[idx]) return nullptr;
          side[s] = base_int[idx];
        }
      }
      o = PyLong_FromLong((side[0] > side[1]) - (side[0] < side[1]));
    }
    if (o == nullptr) {
      PyErr_Clear();
      return nullptr;
    }
    PyTuple_SET_ITEM(key.o, static_cast<Py_ssize_t>(nbase + k), o);
  }
  PyObject* out = key.o;
  key.o = nullptr;
  return out;
}

// The key of a call (a new reference) as ``plan`` reads ``args`` (``plan.arity`` of
// them), or nullptr where it declines.
PyObject* read_key(const Plan& plan, PyObject* const* args) {
  Call c;
  c.args = args;
  c.arity = plan.arity;
  for (int i = 0; i < plan.arity; ++i) c.looked[i] = false;
  for (const Case& cs : plan.cases) {
    bool pass = true;
    for (const Op& op : cs.guards) {
      if (!guard(op, c, plan)) {
        pass = false;
        break;
      }
    }
    if (pass) return key_of(plan, cs, c);
  }
  return nullptr;
}

// key(plan, *args): the key ``lookup`` looks a call up by under ``plan``, or None (what the
// tests hold to the Python keyer).
PyObject* key(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (!astrai_set_up()) return nullptr;
  if (n < 1 || !PyCapsule_IsValid(args[0], kCapsule)) {
    PyErr_SetString(PyExc_TypeError, "key(plan, *args): plan is not a plan");
    return nullptr;
  }
  const Plan* plan = static_cast<const Plan*>(PyCapsule_GetPointer(args[0], kCapsule));
  if (n - 1 != plan->arity) Py_RETURN_NONE;
  Ref hold(args[0]);
  PyObject* got = nullptr;
  try {
    got = read_key(*plan, args + 1);
  } catch (...) {
    got = nullptr;
  }
  if (got == nullptr) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  return got;
}

// lookup(last, *args): the decision the route keeps for this call in its last world,
// (a new reference) or None (always None under autocast). ``last`` is the route's
// one-element list holding ``(world, decisions, keyer, plan)``.
PyObject* lookup(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (!astrai_set_up()) return nullptr;
  if (n < 1 || autocasting()) Py_RETURN_NONE;
  try {
    PyObject* last = args[0];
    if (!PyList_Check(last) || PyList_GET_SIZE(last) != 1) Py_RETURN_NONE;
    Ref seen(PyList_GET_ITEM(last, 0));  // held: the list may be changed meanwhile
    if (!PyTuple_Check(seen.o) || PyTuple_GET_SIZE(seen.o) != 4) Py_RETURN_NONE;
    PyObject* decisions = PyTuple_GET_ITEM(seen.o, 1);
    PyObject* capsule = PyTuple_GET_ITEM(seen.o, 3);
    if (!PyDict_Check(decisions) || !PyCapsule_IsValid(capsule, kCapsule)) Py_RETURN_NONE;
    const Plan* plan = static_cast<const Plan*>(PyCapsule_GetPointer(capsule, kCapsule));
    if (plan == nullptr || n - 1 != plan->arity) {
      PyErr_Clear();
      Py_RETURN_NONE;
    }
    Ref key;
    key.o = read_key(*plan, args + 1);
    if (key.o == nullptr) Py_RETURN_NONE;
    Ref d(PyDict_GetItemWithError(decisions, key.o));
    if (d.o == nullptr) {
      PyErr_Clear();
      Py_RETURN_NONE;
    }
    // The world is checked last: Python code may have run up to here (an allocation that
    // started a collection, a finalizer, another thread), and a world changed meanwhile
    // is declined.
    if (!in_force(PyTuple_GET_ITEM(seen.o, 0))) Py_RETURN_NONE;
    Py_INCREF(d.o);
    return d.o;
  } catch (...) {
    PyErr_Clear();
  }
  Py_RETURN_NONE;
}

// resolved(memo, family, explicit, counter): what ``resolve`` left on a context (its
// ``_resolved``: the world's snapshot, scope, ASTR_OPS, alias key and alias, then the
// family, the explicit request and the answer) when it answers this ask in the world in
// force now (counting the hit on ``counter``, an iterator), else None.
PyObject* resolved(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (!astrai_set_up()) return nullptr;
  if (n != 4) Py_RETURN_NONE;
  if (!PyIter_Check(args[3])) {
    PyErr_SetString(PyExc_TypeError, "resolved(memo, family, explicit, counter): the "
                                     "counter is an iterator");
    return nullptr;
  }
  PyObject* memo = args[0];
  if (!PyTuple_CheckExact(memo) || PyTuple_GET_SIZE(memo) != 8) Py_RETURN_NONE;
  if (PyTuple_GET_ITEM(memo, 5) != args[1] || PyTuple_GET_ITEM(memo, 6) != args[2]) {
    Py_RETURN_NONE;
  }
  Ref held(memo);  // the checks may run Python code (an environment dict's key compare)
  if (!in_force(memo)) Py_RETURN_NONE;
  PyObject* tick = PyIter_Next(args[3]);
  if (tick == nullptr) {
    if (PyErr_Occurred()) return nullptr;
  } else {
    Py_DECREF(tick);
  }
  PyObject* got = PyTuple_GET_ITEM(memo, 7);
  Py_INCREF(got);
  return got;
}

// setup(process_dict, scope_var, environ_data, ops_key, tensor, parameter). What a later
// setup replaces is kept, not released: a call suspended in Python code may still read it.
PyObject* setup(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 6 || !PyDict_Check(args[0]) || !PyContextVar_CheckExact(args[1]) ||
      !PyDict_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError, "setup(process_dict, scope_var, environ_data, ops_key, "
                                     "tensor, parameter): dicts and a ContextVar expected");
    return nullptr;
  }
  if (g.snapshot == nullptr) g.snapshot = PyUnicode_InternFromString("snapshot");
  if (g.cpu == nullptr) g.cpu = PyUnicode_InternFromString("cpu");
  if (g.snapshot == nullptr || g.cpu == nullptr) return nullptr;
  PyObject** slots[] = {&g.scope_var, &g.environ, &g.ops_key, &g.tensor, &g.parameter};
  for (int i = 0; i < 5; ++i) {
    Py_INCREF(args[i + 1]);
    *slots[i] = args[i + 1];
  }
  Py_INCREF(args[0]);
  g.process = args[0];  // last: set means ready
  Py_RETURN_NONE;
}

// tensor_types(tensor, parameter): what the native rows' kernels need of a process (the
// types a plain tensor has); the hot path needs setup's too. astrai.native binds them at
// load, the engine's setup (astrai.dispatch.hot_native) everything.
PyObject* tensor_types(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 2 || !PyType_Check(args[0]) || !PyType_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "tensor_types(tensor, parameter): two types expected");
    return nullptr;
  }
  if (g.tensor == nullptr) {
    Py_INCREF(args[0]);
    g.tensor = args[0];
  }
  if (g.parameter == nullptr) {
    Py_INCREF(args[1]);
    g.parameter = args[1];
  }
  Py_RETURN_NONE;
}

// The opcodes' names, in order, for astrai.dispatch.reading to check against its own.
PyObject* opcodes(PyObject*, PyObject*) {
  return Py_BuildValue(
      "((ssssssssssssssssssss)(sssssssssss)(sss))", "tensor", "tensor_or_none", "is", "float_ge0",
      "int_eq", "bool", "ndim", "ndim_ge", "size_eq", "size_is", "size_ge", "size_even",
      "size_div", "size_twice", "shape_eq", "dtype_eq", "floating", "any", "float", "float_gt0",
      "dtype", "cuda", "ndim", "size",
      "grad", "const", "arg", "rows", "prod", "device", "sm", "interval", "raw", "sign");
}

#define METHOD(name, doc) \
  {#name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(name)), METH_FASTCALL, doc}

PyMethodDef methods[] = {
    METHOD(setup, "Bind the process state, scope variable, environment and tensor types."),
    METHOD(tensor_types, "Bind the tensor types the kernels read (setup binds them too)."),
    {"plan", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(make_plan)),
     METH_FASTCALL, "plan(arity, cases, consts, items, slots) -> capsule"},
    METHOD(lookup, "lookup(last, *args) -> Decision | None"),
    METHOD(key, "key(plan, *args) -> the key lookup reads, or None"),
    METHOD(resolved, "resolved(memo, family, explicit, counter) -> Resolution | None"),
    {"opcodes", opcodes, METH_NOARGS, "() -> (guards, values, key items)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_astrai_hot",
                      "astrai's native extension: the facades' hot path and the native rows' "
                      "CPU kernels (astrai.native).",
                      -1, methods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

// ``plain`` for the native rows' kernels (astrai/native/kernels.cpp): whether ``obj``
// is a tensor this file reads as Python would.
bool astrai_plain_tensor(PyObject* obj) { return typed() && plain(obj) != nullptr; }

// Whether the kernels' types are bound; false with a RuntimeError set otherwise.
bool astrai_set_up() {
  if (typed()) return true;
  PyErr_SetString(PyExc_RuntimeError,
                  "astrai's native extension was imported but never set up "
                  "(astrai.native.load_from sets it up)");
  return false;
}

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
