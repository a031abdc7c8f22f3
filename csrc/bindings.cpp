// The extension module pyfedkern._C. Arguments arrive as plain integers (data pointers, strides), floats and
// dtype names from pyfedkern's Python layer, which validates them; kernels run with the GIL released.
#include "bindings.h"

#include "types.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "pyfedkern native kernels (C++ and CUDA); use the pyfedkern.ops API, not this module";
  pybind11::register_exception<pfk::ArgumentError>(m, "ArgumentError", PyExc_ValueError);
  pfk::bind_runtime(m);
  pfk::bind_aggregate(m);
  pfk::bind_norms(m);
  pfk::bind_pbc(m);
  pfk::bind_sampling(m);
  pfk::bind_fedspeed(m);
  pfk::bind_herding(m);
  pfk::bind_similarity(m);
  pfk::bind_dp(m);
  pfk::bind_robust(m);
}
