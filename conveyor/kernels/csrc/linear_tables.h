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

// AMX-BF16 (moe_amx.cpp): whether this CPU has it and the kernel may use it
// (asks the OS for the tile state once; false without AMX or permission), and
// the bf16 kernel (nullptr where not built). Its x must have 15 readable rows
// past its last and kp % 32 == 0.
bool amx_request_permission();
LinearFn linear_amx_bf16();
}  // namespace conveyor_linear
