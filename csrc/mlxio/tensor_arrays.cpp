#include "mlxio/tensor_arrays.h"

#include <climits>

#include "core/errors.h"
#include "mlx/allocator.h"

namespace mx = mlx::core;

namespace pyloader {

mx::Dtype to_mlx_dtype(const TensorInfo& t, const std::string& file) {
  switch (t.dtype) {
    case DType::BOOL: return mx::bool_;
    case DType::U8:
    case DType::F8_E4M3:
    case DType::F8_E5M2:
    case DType::F8_E8M0:
    case DType::F8_E4M3FNUZ:
    case DType::F8_E5M2FNUZ: return mx::uint8;
    case DType::I8: return mx::int8;
    case DType::I16: return mx::int16;
    case DType::U16: return mx::uint16;
    case DType::F16: return mx::float16;
    case DType::BF16: return mx::bfloat16;
    case DType::I32: return mx::int32;
    case DType::U32: return mx::uint32;
    case DType::F32: return mx::float32;
    case DType::F64: return mx::float64;
    case DType::I64: return mx::int64;
    case DType::U64: return mx::uint64;
    case DType::C64: return mx::complex64;
    default: break;
  }
  throw UnsupportedError(file + ": tensor '" + printable_name(t.name) + "': dtype " +
                         dtype_name(t.dtype) + " has no MLX array type");
}

mx::Shape to_mlx_shape(const TensorInfo& t, const std::string& file) {
  mx::Shape shape;
  shape.reserve(t.shape.size());
  for (uint64_t d : t.shape) {
    if (d > static_cast<uint64_t>(INT32_MAX))
      throw UnsupportedError(file + ": tensor '" + printable_name(t.name) + "': dimension " +
                             std::to_string(d) + " exceeds MLX's int32 shape limit");
    shape.push_back(static_cast<int32_t>(d));
  }
  return shape;
}

}  // namespace pyloader
