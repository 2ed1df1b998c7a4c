// The one extension module of quantspec's CPU kernels: every source file of the build binds its
// ops through `qs_bind::Register` (cpu.h); this file defines the registry and the module.

#include "cpu.h"

namespace qs_bind {
std::vector<Binder>& binders() {
  static std::vector<Binder> all;
  return all;
}
}  // namespace qs_bind

bool has_avx512() { return QS_AVX512 != 0; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_avx512", &has_avx512);
  for (qs_bind::Binder bind : qs_bind::binders()) bind(m);
}
