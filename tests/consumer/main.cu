// SPDX-License-Identifier: Apache-2.0
//! @file main.cu  A minimal consumer engine: compiles the whole library, plans against a missing
//! device gracefully, and checks a few host-only results. Its SparseFfn<__half> is compiled once, in
//! instances.cu: this file declares it extern and so compiles no kernel (CMakeLists.txt checks). Both
//! files form a shared module, as an engine's Python extension does; host.cpp calls consumer_checks().
#include <prox/prox.cuh>

#include <cstdio>

PROX_SPARSE_FFN_EXTERN(__half, prox::SiLU, prox::Int4Weights)

//! The module's one export. Returns 0 when every check passed, else the number of the failed one.
extern "C" __attribute__((visibility("default"))) int consumer_checks() {
  prox::StageSparsity s;
  if (prox::allocate_sparsity(0.5, &s) != prox::Status::kSuccess || s.s2 != 0.7) return 1;
  prox::SparseFfn<__half> ffn;
  prox::SparseFfn<__half>::Weights w;  // all null: plan must refuse before touching the device
  if (ffn.plan({4096, 12288, 0.1f, 0.1f}, w) != prox::Status::kErrorNullPointer) return 2;
  // run() before a successful plan() refuses too (and links against instances.cu's definition).
  if (ffn.run(nullptr, nullptr, nullptr, 0, nullptr) != prox::Status::kErrorNotPlanned) return 3;
  std::printf("prox %s consumer ok: e=50%% -> s1=%.2f s2=%.2f\n", PROX_VERSION_STRING, s.s1, s.s2);
  return 0;
}
