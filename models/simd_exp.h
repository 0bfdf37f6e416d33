// e^x for x <= 0 on a GCC/Clang vector of floats (V) with its int32 vector of the same lanes (IV), in plain
// arithmetic (libm's expf does not vectorize unless built with -ffast-math): Cody-Waite range reduction and
// Cephes' degree-6 polynomial, within 2 ulp of expf over [-87, 0]; below -87 it returns e^-87 (about
// 1.6e-38), so callers zero masked scores apart. Shared by the CPU attention kernels.
#pragma once

#include <cstring>

template <typename V, typename IV>
inline V exp_nonpositive_lanes(V x) {
  const V lowest = V{} - 87.0f, magic = V{} + 12582912.0f;
  x = x < lowest ? lowest : x;
  const V n = (x * 1.44269504088896341f + magic) - magic;
  const V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const IV bits = (__builtin_convertvector(n, IV) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}
