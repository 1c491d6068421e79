// SPDX-License-Identifier: Apache-2.0
//! @file main.cu  A minimal consumer: compiles the whole library, plans against a missing device
//! gracefully, and checks a few host-only results.
#include <prox/prox.cuh>

#include <cstdio>

int main() {
  prox::StageSparsity s;
  if (prox::allocate_sparsity(0.5, &s) != prox::Status::kSuccess || s.s2 != 0.7) return 1;
  prox::SparseFfn<__half> ffn;
  prox::SparseFfn<__half>::Weights w;  // all null: plan must refuse before touching the device
  if (ffn.plan({4096, 12288, 0.1f, 0.1f}, w) != prox::Status::kErrorNullPointer) return 2;
  std::printf("prox %s consumer ok: e=50%% -> s1=%.2f s2=%.2f\n", PROX_VERSION_STRING, s.s1, s.s2);
  return 0;
}
