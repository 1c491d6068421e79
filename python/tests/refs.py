# SPDX-License-Identifier: Apache-2.0
"""The float64 reference of prox with error bounds (a torch port of tests/reference/reference.hpp), so the
GPU tests can tell an fp32 kernel's rounding from a bug."""
from __future__ import annotations

import math

import torch

from prox import reference

EPS32 = 2.0 ** -24
EPS16 = 2.0 ** -11
ACT_SLOPE = 1.2
INT4_STEP_ROWS = 4


def gamma(n):
    return (n + 64.0) * EPS32


def act64(act, g):
    if act == "silu":
        return g / (1.0 + torch.exp(-g))
    c = math.sqrt(2.0 / math.pi)
    return 0.5 * g * (1.0 + torch.tanh(c * (g + 0.044715 * g ** 3)))


def glu_bounded(act, g, eg, u, eu):
    """s = u act(g) and its bound (reference.hpp glu())."""
    h = act64(act, g)
    s = u * h
    err = h.abs() * eu + u.abs() * ACT_SLOPE * eg + eu * ACT_SLOPE * eg + 8 * EPS32 * s.abs() + \
        16 * EPS32 * u.abs() * g.abs()
    return s, err


def stage1(x, packed_g, scale_g, packed_u, scale_u, tau_x, act):
    """s~ [d_ff] float64 with bound, for one token x [d_model] (any float dtype)."""
    xd = x.double().reshape(-1)
    kept = x.float().reshape(-1).abs() >= tau_x
    xk = torch.where(kept, xd, torch.zeros_like(xd))
    qg = reference.unpack_int4(packed_g).double()
    qu = reference.unpack_int4(packed_u).double()
    g, u = qg @ xk, qu @ xk
    ag, au = qg.abs() @ xk.abs(), qu.abs() @ xk.abs()
    n = int(kept.sum())
    small = (xd.abs() < 2.0 ** -8) & kept
    sub = (9.0 * small.sum() + 1.0 * (kept & ~small).sum()).item() * 2.0 ** -19
    eg = gamma(n) * ag + INT4_STEP_ROWS * EPS16 * ag + sub + EPS32 * g.abs()
    eu = gamma(n) * au + INT4_STEP_ROWS * EPS16 * au + sub + EPS32 * u.abs()
    sg, su = scale_g.double(), scale_u.double()
    return glu_bounded(act, g * sg, eg * sg, u * su, eu * su)


def stage2(x, w_gate, w_up, w_down_t, sel, act):
    """(s, s_err, y, y_err) in float64 for one token on the channel set sel (bool [d_ff])."""
    xd = x.double().reshape(-1)
    K = xd.numel()
    wg, wu, wdt = w_gate.double(), w_up.double(), w_down_t.double()
    g, u = wg @ xd, wu @ xd
    ag, au = wg.abs() @ xd.abs(), wu.abs() @ xd.abs()
    s, es = glu_bounded(act, g, gamma(K) * ag, u, gamma(K) * au)
    s = torch.where(sel, s, torch.zeros_like(s))
    es = torch.where(sel, es, torch.zeros_like(es))
    y = s @ wdt
    ey = es @ wdt.abs() + gamma(int(sel.sum())) * (s.abs() @ wdt.abs())
    return s, es, y, ey


def store_rel(dtype):
    return 2.0 ** -11 if dtype == torch.float16 else 2.0 ** -8


def dense(x, w_gate, w_up, w_down_t, act):
    xd = x.double().reshape(-1)
    return (w_up.double() @ xd * act64(act, w_gate.double() @ xd)) @ w_down_t.double()
