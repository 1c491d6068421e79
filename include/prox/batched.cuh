// SPDX-License-Identifier: Apache-2.0
//! @file batched.cuh  Batched decode: the Prox FFN's ops for 2..8 tokens per call (speculative
//! verification, small-batch serving, beam search).
//!
//! Semantics: every token gets what batch-1 Prox would give it -- its own Stage-1 input set, its own
//! channel set and its own exact Stage-2 result -- while each weight row is read once per call when any
//! token needs it:
//!   BatchedProxyGemvOp  Stage 1 over the union of the tokens' kept inputs: a token's x is 0 on a row
//!                       it did not keep, so the row adds nothing to its sums. Per-token channel masks
//!                       and their union.
//!   BatchedGluGemvOp    exact gate/up rows of the union's channels, every token's dot products from
//!                       the same bytes; s[b][j] = u * act(g) where token b selected j, else +0.
//!   BatchedDownGemvOp   the union's rows of W_down^T, each token weighted by its own s (0 where it did
//!                       not select the channel).
//! Each op is a planned op (operator.cuh's contract) with a compile-time token capacity kTokens (2, 4
//! or 8: the tile shapes follow it) and a run-time `tokens` in [1, kTokens]. SparseFfn::run_batch
//! drives them. INT4 proxy weights only (the method); the A1 ablation's fp16 proxies stay batch-1. The
//! Stage-2 ops take a Stage-2 weight format (stage2_weights.cuh) as their batch-1 counterparts do, and share
//! their blocks (detail::GluRows, detail::DownRows: templated on the token count).
//!
//! This header is the umbrella of the three families: batched_proxy.cuh (Stage 1), batched_glu.cuh (the GLU
//! GEMV) and batched_down.cuh (the down GEMV); batched_glu_down.cuh fuses the last two.
//!
//! Results are deterministic (fixed assignment of work, fixed addition order) but not bit-identical to
//! batch 1: the union changes how kept rows are grouped into Stage 1's fp16 steps and its split-K
//! chunks' row groups, and the batched kernels' reduction trees differ from batch 1's (docs/api.md).
#pragma once

#include "batched_down.cuh"
#include "batched_glu.cuh"
#include "batched_proxy.cuh"
