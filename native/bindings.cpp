#include <pybind11/pybind11.h>
#include "tnt/version.hpp"
namespace py = pybind11;
PYBIND11_MODULE(_native, m) {
  m.doc() = "tnt_notebook native core";
  m.def("version", &tnt::version);
}
