// The linear kernel table for an ISA name, for the glue files only (the ISA
// files must not include <string>: its inline code would be compiled under
// their raised targets, see cpu_kernels.h).
#pragma once

#include <string>

#include "linear_kernels.h"

namespace conveyor_linear {
// "auto" = the best table this CPU runs; an unknown or unsupported name fails
// with the best one named.
const LinearTable* table_named(const std::string& isa);
}  // namespace conveyor_linear
