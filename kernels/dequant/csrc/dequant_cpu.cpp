// Krul's host rows back into the KV pool (CPU): dequantize and scatter in one pass.
//
// For each i: out[dst[i], h, :] = codes[rows[i], h, :] * scale[rows[i], h], converted to
// the pool's dtype. codes are int8 [R, H, D] (8 bits) or uint8 [R, H, D/2] (4 bits, two
// values a byte, offset by 8, even element in the low nibble: krul/quant.py's pack4);
// scale is bf16 [R, H]. The torch reference is kernels/dequant/reference.py (the codec's
// own dequantize, then an indexed write); the tests compare the two. Nothing is
// allocated: the codes are read once, each output row written once.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstring>

namespace {

inline float bf16_to_f(uint16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f_to_bf16(float f) {  // round to nearest even (finite inputs)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

template <typename Out, int BITS>
void run(const void* codes, const uint16_t* scale, const int64_t* rows, const int64_t* dst,
         Out* out, int64_t n, int64_t H, int64_t D) {
  const int64_t row_codes = BITS == 8 ? H * D : H * D / 2;
  at::parallel_for(0, n, 16, [&](int64_t lo, int64_t hi) {
    float buf[1024];  // one head's values (D <= 1024)
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t r = rows[i];
      for (int64_t h = 0; h < H; ++h) {
        const float s = bf16_to_f(scale[r * H + h]);
        if constexpr (BITS == 8) {
          const int8_t* c = static_cast<const int8_t*>(codes) + r * row_codes + h * D;
          for (int64_t d = 0; d < D; ++d) buf[d] = static_cast<float>(c[d]) * s;
        } else {
          const uint8_t* c = static_cast<const uint8_t*>(codes) + r * row_codes + h * D / 2;
          for (int64_t d = 0; d < D / 2; ++d) {
            buf[2 * d] = static_cast<float>(static_cast<int>(c[d] & 15) - 8) * s;
            buf[2 * d + 1] = static_cast<float>(static_cast<int>(c[d] >> 4) - 8) * s;
          }
        }
        Out* o = out + (dst[i] * H + h) * D;
        if constexpr (std::is_same_v<Out, uint16_t>) {
          for (int64_t d = 0; d < D; ++d) o[d] = f_to_bf16(buf[d]);
        } else if constexpr (std::is_same_v<Out, at::Half>) {
          for (int64_t d = 0; d < D; ++d) o[d] = at::Half(buf[d]);
        } else {
          for (int64_t d = 0; d < D; ++d) o[d] = buf[d];
        }
      }
    }
  });
}

template <int BITS>
void dispatch_out(const torch::Tensor& codes, const torch::Tensor& scale, const int64_t* rows,
                  const int64_t* dst, torch::Tensor& out, int64_t n, int64_t H, int64_t D) {
  const auto* sc = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::BFloat16>());
  switch (out.scalar_type()) {
    case at::kBFloat16:
      run<uint16_t, BITS>(codes.data_ptr(), sc, rows, dst,
                          reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), n, H, D);
      break;
    case at::kHalf:
      run<at::Half, BITS>(codes.data_ptr(), sc, rows, dst, out.data_ptr<at::Half>(), n, H, D);
      break;
    default:
      run<float, BITS>(codes.data_ptr(), sc, rows, dst, out.data_ptr<float>(), n, H, D);
  }
}

}  // namespace

// out[dst] = dequant(codes[rows], scale[rows]); checks are in kernels/dequant/__init__.py.
void dequant_scatter(const torch::Tensor& codes, const torch::Tensor& scale, int64_t bits,
                     const torch::Tensor& rows, torch::Tensor out, const torch::Tensor& dst) {
  const int64_t n = rows.numel(), H = out.size(1), D = out.size(2);
  TORCH_CHECK(D <= 1024, "head_dim over 1024");
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* d = dst.data_ptr<int64_t>();
  if (bits == 8) dispatch_out<8>(codes, scale, r, d, out, n, H, D);
  else dispatch_out<4>(codes, scale, r, d, out, n, H, D);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dequant_scatter", &dequant_scatter, "dequantize host rows into pool slots");
}
