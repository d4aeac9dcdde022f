// The VNNI multiply both AVX-512 int8 kernels make (qlinear_avx512.cpp,
// qlinear_kquant_avx512.cpp): each includes it INSIDE its anonymous namespace, after its
// target pragma, so each gets its own internal copy compiled for AVX-512 VNNI.

// acc + in each 32-bit lane the dot product of u's 4 unsigned bytes with the 4 signed
// activation bytes at p: vpdpbusd with those bytes as its broadcast memory operand
// ({1to16}). GCC does not fold _mm512_set1_epi32 of them into the multiply: it spent a
// vpbroadcastd per vpdpbusd (Zen 4: 0.94-0.98x the time of the K-quant linears without it).
inline __m512i dpbusd_bcast(__m512i acc, __m512i u, const int8_t* p) {
  asm("vpdpbusd %[x]%{1to16%}, %[u], %[acc]"
      : [acc] "+v"(acc)
      : [u] "v"(u), [x] "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// acc + in each 32-bit lane the dot product of v's int16 pair with the int16 pair at p:
// vpdpwssd with the pair as its broadcast memory operand, for the same reason.
inline __m512i dpwssd_bcast(__m512i acc, __m512i v, const int16_t* p) {
  asm("vpdpwssd %[x]%{1to16%}, %[v], %[acc]"
      : [acc] "+v"(acc)
      : [v] "v"(v), [x] "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}
