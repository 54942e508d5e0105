// A tiny extension for tests/test_kernel_build.py: compiles in a few seconds (pybind11 only, no torch headers).
#include <pybind11/pybind11.h>

static int answer() { return 42; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer, "42"); }
