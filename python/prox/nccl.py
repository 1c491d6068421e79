# SPDX-License-Identifier: Apache-2.0
"""libnccl through ctypes (as vLLM's pynccl_wrapper binds it): the few entry points a decode step's all-reduce
needs (prox.distributed.NcclCommunicator), no compiled code, and the NCCL torch already loaded."""
from __future__ import annotations

import ctypes
import glob
import os
import sys
from typing import Optional

import torch

#: ncclDataType_t of the torch dtypes an all-reduce takes (nccl.h)
NCCL_DTYPES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6, torch.float32: 7,
               torch.float64: 8, torch.bfloat16: 9}
NCCL_SUM = 0
NCCL_IN_PROGRESS = 7  # ncclInProgress: a non-blocking communicator's normal answer


class _NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


def find_libnccl() -> str:
    """The libnccl to load: $PROX_NCCL_LIBRARY; else the libnccl this process has already mapped (torch's own,
    so one NCCL serves both); else an nvidia-nccl wheel's on sys.path; else the system's, by soname."""
    env = os.environ.get("PROX_NCCL_LIBRARY")
    if env:
        return env
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and os.path.basename(parts[5].strip()).startswith("libnccl.so"):
                    return parts[5].strip()
    except OSError:
        pass
    for d in sys.path:
        found = sorted(glob.glob(os.path.join(d, "nvidia", "nccl", "lib", "libnccl.so*")))
        if found:
            return found[0]
    return "libnccl.so.2"


class NcclLibrary:
    """The few NCCL entry points a decode step's all-reduce needs, bound through ctypes (as vLLM's
    pynccl_wrapper binds them): no compiled code, and the NCCL torch already loaded."""

    _loaded: dict = {}

    def __init__(self, path: Optional[str] = None):
        self.path = path or find_libnccl()
        try:
            lib = ctypes.CDLL(self.path)
        except OSError as exc:
            raise RuntimeError(f"prox: cannot load libnccl ({self.path}): {exc}; set PROX_NCCL_LIBRARY") from exc
        vp, i = ctypes.c_void_p, ctypes.c_int
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [i]
        lib.ncclGetVersion.argtypes = [ctypes.POINTER(i)]
        lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(_NcclUniqueId)]
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(vp), i, _NcclUniqueId, i]
        lib.ncclAllReduce.argtypes = [vp, vp, ctypes.c_size_t, i, i, vp, vp]
        lib.ncclCommDestroy.argtypes = [vp]
        self.lib = lib
        self.all_reduce = lib.ncclAllReduce  # the hot path calls it directly

    @classmethod
    def get(cls, path: Optional[str] = None) -> "NcclLibrary":
        key = path or find_libnccl()
        if key not in cls._loaded:
            cls._loaded[key] = cls(key)
        return cls._loaded[key]

    def check(self, r: int, what: str) -> None:
        if r != 0 and r != NCCL_IN_PROGRESS:
            raise RuntimeError(f"prox: {what} failed: NCCL error {r}: {self.lib.ncclGetErrorString(r).decode()}")

    def version(self) -> str:
        v = ctypes.c_int()
        self.check(self.lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        code = v.value  # major * 10000 + minor * 100 + patch since NCCL 2.9
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"

    def unique_id(self) -> bytes:
        uid = _NcclUniqueId()
        self.check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(ctypes.string_at(ctypes.addressof(uid), 128))

    def comm_init_rank(self, world: int, uid: bytes, rank: int) -> ctypes.c_void_p:
        u = _NcclUniqueId()
        ctypes.memmove(ctypes.addressof(u), uid, 128)
        comm = ctypes.c_void_p()
        self.check(self.lib.ncclCommInitRank(ctypes.byref(comm), world, u, rank), "ncclCommInitRank")
        return comm

    def comm_destroy(self, comm: ctypes.c_void_p) -> None:
        self.check(self.lib.ncclCommDestroy(comm), "ncclCommDestroy")
