// One bind_<family>() per op family; bindings.cpp calls each to build the module pyfedkern._C.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

namespace pfk {
namespace py = pybind11;

void bind_runtime(py::module_& m);
void bind_aggregate(py::module_& m);
void bind_norms(py::module_& m);
void bind_pbc(py::module_& m);
void bind_sampling(py::module_& m);
void bind_fedspeed(py::module_& m);
void bind_herding(py::module_& m);
void bind_similarity(py::module_& m);
void bind_dp(py::module_& m);
void bind_robust(py::module_& m);

}  // namespace pfk
