// Stand-ins for parameters whose bytes are not in memory.
//
// A stand-in is an mx::array with the parameter's shape and dtype (so every
// read of .shape, .dtype, .size or .nbytes is right) and no data: its
// primitive throws StandInRead from eval, so no computation can produce a
// number from it. Whatever reads a streamed parameter outside its unit — a
// forward that calls a layer's submodules directly, reads .weight in its own
// code, or runs layers twice — fails at the evaluation that would have used
// it, before any token is returned, instead of computing with zeros.
#pragma once

#include <string>

#include "mlx/array.h"

namespace pyloader {

// An array of `shape` and `dtype` whose evaluation throws
// StandInRead(message). It allocates nothing; many may share one message.
mlx::core::array stand_in_array(const mlx::core::Shape& shape, mlx::core::Dtype dtype,
                                const std::string& message);

}  // namespace pyloader
