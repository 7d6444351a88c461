// The Python module of the native kernels: each C entry point of kernels.h as a function of the
// module (METH_FASTCALL), with no ctypes and no per-call table of argument types. Each argument's
// conversion is chosen from the C parameter's own type (so the two cannot disagree):
//
//   int, int64_t      a Python int (range-checked);
//   float, double     a Python float or int;
//   T*                a memory address (a Python int, a tensor's data_ptr()) or None (null);
//   const int64_t*    also a tuple of at most 32 ints (dims, strides), copied for the call;
//   T* const*         a tuple of at most 16 addresses or None (the weights of a layer).
//
// A wrong count or type raises TypeError naming the function and the argument's position,
// before the kernel runs. The kernel runs without the GIL. The module is built once per vector
// width (MH_MODULE names it: _kernels_avx2, _kernels_avx512, ...); Python checks what it may
// call (shapes, dtypes, capacities): the addresses are trusted here.
#include <Python.h>

#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>

#include "kernels.h"

#ifndef MH_MODULE
#error "MH_MODULE must name the module (e.g. -DMH_MODULE=_kernels_avx2)"
#endif
#define MH_STR2(x) #x
#define MH_STR(x) MH_STR2(x)
#define MH_CAT2(a, b) a##b
#define MH_CAT(a, b) MH_CAT2(a, b)

namespace {

bool fail(const char* fn, size_t i, const char* want) {
    PyErr_Format(PyExc_TypeError, "%s: argument %zu must be %s", fn, i, want);
    return false;
}

template <typename T, typename = void>
struct Arg;

template <typename T>
struct Arg<T, std::enable_if_t<std::is_integral_v<T>>> {
    T value{};
    bool set(PyObject* o, const char* fn, size_t i) {
        if (!PyLong_Check(o)) return fail(fn, i, "an int");
        long long x = PyLong_AsLongLong(o);
        if (x == -1 && PyErr_Occurred()) return false;
        if (static_cast<long long>(static_cast<T>(x)) != x) return fail(fn, i, "an int in the C type's range");
        value = static_cast<T>(x);
        return true;
    }
};

template <typename T>
struct Arg<T, std::enable_if_t<std::is_floating_point_v<T>>> {
    T value{};
    bool set(PyObject* o, const char* fn, size_t i) {
        if (!PyFloat_Check(o) && !PyLong_Check(o)) return fail(fn, i, "a float");
        double x = PyFloat_AsDouble(o);
        if (x == -1.0 && PyErr_Occurred()) return false;
        value = static_cast<T>(x);
        return true;
    }
};

// An address (a Python int) or None.
bool address(PyObject* o, void** out, const char* fn, size_t i) {
    if (o == Py_None) {
        *out = nullptr;
        return true;
    }
    if (!PyLong_Check(o)) return fail(fn, i, "an address (int) or None");
    void* p = PyLong_AsVoidPtr(o);
    if (p == nullptr && PyErr_Occurred()) return false;
    *out = p;
    return true;
}

template <typename T>
struct Arg<T*, std::enable_if_t<!std::is_pointer_v<std::remove_cv_t<T>> && !std::is_same_v<T, const int64_t>>> {
    T* value = nullptr;
    bool set(PyObject* o, const char* fn, size_t i) {
        void* p;
        if (!address(o, &p, fn, i)) return false;
        value = static_cast<T*>(p);
        return true;
    }
};

// dims and strides: a tuple of ints copied here, or an address (a tensor's data) or None.
template <>
struct Arg<const int64_t*> {
    static constexpr Py_ssize_t CAP = 32;
    int64_t buf[CAP];
    const int64_t* value = nullptr;
    bool set(PyObject* o, const char* fn, size_t i) {
        if (!PyTuple_Check(o)) {
            void* p;
            if (!address(o, &p, fn, i)) return false;
            value = static_cast<const int64_t*>(p);
            return true;
        }
        Py_ssize_t n = PyTuple_GET_SIZE(o);
        if (n > CAP) return fail(fn, i, "a tuple of at most 32 ints");
        for (Py_ssize_t j = 0; j < n; ++j) {
            PyObject* x = PyTuple_GET_ITEM(o, j);
            if (!PyLong_Check(x)) return fail(fn, i, "a tuple of ints");
            buf[j] = PyLong_AsLongLong(x);
            if (buf[j] == -1 && PyErr_Occurred()) return false;
        }
        value = buf;
        return true;
    }
};

// Arrays of addresses (a layer's weights, biases, outputs): a tuple of ints or None.
template <typename T>
struct Arg<T* const*, std::enable_if_t<!std::is_pointer_v<std::remove_cv_t<T>>>> {
    static constexpr Py_ssize_t CAP = 16;
    T* buf[CAP];
    T* const* value = nullptr;
    bool set(PyObject* o, const char* fn, size_t i) {
        if (o == Py_None) {  // no array: a null
            value = nullptr;
            return true;
        }
        if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) > CAP)
            return fail(fn, i, "a tuple of at most 16 addresses or None");
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(o); ++j) {
            void* p;
            if (!address(PyTuple_GET_ITEM(o, j), &p, fn, i)) return false;
            buf[j] = static_cast<T*>(p);
        }
        value = buf;
        return true;
    }
};

template <typename... A, size_t... I>
PyObject* call(int (*fn)(A...), const char* name, PyObject* const* args, Py_ssize_t n, std::index_sequence<I...>) {
    if (n != static_cast<Py_ssize_t>(sizeof...(A))) {
        PyErr_Format(PyExc_TypeError, "%s takes %zu arguments, got %zd", name, sizeof...(A), n);
        return nullptr;
    }
    std::tuple<Arg<A>...> conv;
    if (!(std::get<I>(conv).set(args[I], name, I) && ... && true)) return nullptr;
    int code;
    Py_BEGIN_ALLOW_THREADS
    code = fn(std::get<I>(conv).value...);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(code);
}

template <auto Fn>
struct Entry;

template <typename... A, int (*Fn)(A...)>
struct Entry<Fn> {
    static const char* name;
    static PyObject* run(PyObject*, PyObject* const* args, Py_ssize_t n) {
        return call(Fn, name, args, n, std::index_sequence_for<A...>{});
    }
};
template <typename... A, int (*Fn)(A...)>
const char* Entry<Fn>::name = "";

#define MH_ENTRY(f) {#f, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(&Entry<&f>::run)), \
                     METH_FASTCALL, nullptr}
#define MH_NAME(f) Entry<&f>::name = #f

PyMethodDef methods[] = {
    MH_ENTRY(mh_attention_f32), MH_ENTRY(mh_attention_bf16), MH_ENTRY(mh_attention_f16),
    MH_ENTRY(mh_decode_f32), MH_ENTRY(mh_decode_bf16), MH_ENTRY(mh_decode_f16),
    MH_ENTRY(mh_attention_backward_f32), MH_ENTRY(mh_attention_backward_f64), MH_ENTRY(mh_attention_forward_f64),
    MH_ENTRY(mh_linear_few_rows_f32), MH_ENTRY(mh_decode_step_f32), MH_ENTRY(mh_decode_step_bf16),
    MH_ENTRY(mh_decode_step_f16), MH_ENTRY(mh_advance_counters), MH_ENTRY(mh_convert_scalar),
    MH_ENTRY(mh_vector_bits), MH_ENTRY(mh_amx_ready), MH_ENTRY(mh_amx_switch), MH_ENTRY(mh_max_step_rows),
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, MH_STR(MH_MODULE), "multihead's native CPU kernels.", -1, methods,
                      nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC MH_CAT(PyInit_, MH_MODULE)() {
    MH_NAME(mh_attention_f32); MH_NAME(mh_attention_bf16); MH_NAME(mh_attention_f16);
    MH_NAME(mh_decode_f32); MH_NAME(mh_decode_bf16); MH_NAME(mh_decode_f16);
    MH_NAME(mh_attention_backward_f32); MH_NAME(mh_attention_backward_f64); MH_NAME(mh_attention_forward_f64);
    MH_NAME(mh_linear_few_rows_f32); MH_NAME(mh_decode_step_f32); MH_NAME(mh_decode_step_bf16);
    MH_NAME(mh_decode_step_f16); MH_NAME(mh_advance_counters); MH_NAME(mh_convert_scalar);
    MH_NAME(mh_vector_bits); MH_NAME(mh_amx_ready); MH_NAME(mh_amx_switch); MH_NAME(mh_max_step_rows);
    return PyModule_Create(&module);
}
