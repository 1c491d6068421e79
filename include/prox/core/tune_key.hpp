// SPDX-License-Identifier: Apache-2.0
//! @file tune_key.hpp  What a tunable op states about itself for the tuning cache: the fields of its
//! cache key other than the shape and the density. Host-only and free of the tuning headers: an op's
//! header defines `static constexpr TuneKeyFields kTuneKey`, and prox/tuning/choose.cuh's OpKey<Op>
//! builds the key from it (docs/tuning.md, "Keys and values"; "Adding a tuned op").
#pragma once

#include "config.hpp"

PROX_NAMESPACE_BEGIN

/**
 * @brief A tunable op's cache-key fields: op, dtype, weights, act, and whether d_ff is part of the key.
 * The strings are the file's text (a changed one orphans the entries cached under the old one), so they
 * are literals or kName constants. `op` names the op's candidate list: one list, one name (the key of
 * the policy table); nullptr means the op has no key (a ProxyGemvOp with a candidate list of its own).
 */
struct TuneKeyFields {
  const char* op;       //!< the candidate list's name in the file, e.g. "glu_gemv"
  const char* dtype;    //!< the element type: DTypeTraits<T>::kName
  const char* weights;  //!< the weight format and its layout version, or "-" for an op without weights
  const char* act;      //!< the activation: Act::kName, or "-" for an op without one
  bool has_d_ff;        //!< false: the op's length is d_model and the key's d_ff is 0 (the threshold op)
};

PROX_NAMESPACE_END
