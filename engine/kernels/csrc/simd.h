// The vector layer every kernel is written in: one source per op, built once per target (targets.py)
// with that target's compiler flags, each build in its own C++ namespace tandem::<target> and its own
// torch op namespace (tandem_<target>), so several targets load side by side in one process.
//
// Each target's header (simd/<arch>.h) defines, in tandem::<target>::simd:
//   kLanes, kRegisters     floats per register, vector registers
//   kVnni                  whether dot_u8s8 is one instruction (vpdpbusd)
//   F, I, M                float vector, int32 vector, lane mask
//   zero set1 loadu storeu; first(n): lanes [0, n); lanes(from, to); load/store under a mask (masked
//   lanes read as 0, are never touched); keep(m, v): v where m, else 0
//   add sub mul div max min fmadd fnmadd abs round_even scale_pow2 reduce_add reduce_max
//   from_half from_i8 widen_u8 from_byte_planes to_float prefetch reduce4 transpose_sums
//   zero_i set1_i loadu_i add_i low_nibbles high_nibbles dot_u8s8 dot_u8s8_wide round_to_i8
//
// Lane-wise arithmetic is IEEE float32 on every target; reductions (reduce_add, reduce4,
// transpose_sums) add in each target's own fixed tree, so float kernels may differ across targets in
// the last bits, never within one. Integer dot products are exact everywhere.
//
// Another architecture (ARM NEON, SVE) is a header simd/<arch>.h defining the same names and a row in
// engine/kernels/targets.py with its flags; the kernels' sources don't change.
#pragma once

#ifndef TANDEM_ISA
#error "TANDEM_ISA (the target's name) is set by engine/kernels/build.py"
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#include "simd/avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "simd/avx2.h"
#else
#error "no vector layer for this target's flags"
#endif

// TORCH_LIBRARY* stringify their namespace argument: expand TANDEM_OPS (tandem_<target>) first.
#define TANDEM_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define TANDEM_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define TANDEM_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)
