# SPDX-License-Identifier: Apache-2.0
"""Build prox._C with torch's own cpp_extension (the installed torch's compiler flags, C++ ABI and
CUDA). The library's headers are read from the repository's include/ (PROX_INCLUDE_DIR overrides).

Environment:
  TORCH_CUDA_ARCH_LIST  architectures to compile (default "8.0;9.0a": A100-class and H100/H200)
  MAX_JOBS              parallel compile jobs (ninja)
  PROX_INCLUDE_DIR      prox's include directory (default: ../include next to this file)
  CXX                   the C++ compiler (torch's cpp_extension reads it); the extension links the shared
                        libstdc++ torch's process has loaded, whatever libstdc++ the compiler would pick
                        (prox/_abi.py: a static one in the extension crashes the first error it raises)
"""
import importlib.util
import os
import re
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent


def prox_include_dir() -> Path:
    d = Path(os.environ.get("PROX_INCLUDE_DIR", HERE.parent / "include")).resolve()
    if not (d / "prox" / "prox.cuh").is_file():
        raise RuntimeError(f"prox headers not found in {d}: build from the repository (pip install ./python) "
                           "or set PROX_INCLUDE_DIR")
    return d


def prox_version(inc: Path) -> str:
    text = (inc / "prox" / "version.hpp").read_text()
    m = re.search(r'#define PROX_VERSION_STRING "([^"]+)"', text)
    return m.group(1) if m else "0.0.0"


def load_abi():
    """prox/_abi.py by path (the package itself cannot be imported before its extension is built)."""
    spec = importlib.util.spec_from_file_location("_prox_abi", HERE / "prox" / "_abi.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    abi = load_abi()
    # Link the libstdc++.so.6 that torch runs with, by path, ahead of the driver's own -lstdc++: every C++
    # runtime symbol then resolves to it, and a compiler that finds libstdc++.a first (a relocated GCC)
    # pulls nothing from the archive. The check after the link (ProxBuildExt) makes sure.
    libstdcxx = abi.loaded_libstdcxx()
    link_args = [libstdcxx] if libstdcxx else []

    class ProxBuildExt(BuildExtension.with_options(use_ninja=True)):
        def build_extension(self, ext):
            super().build_extension(ext)
            path = self.get_ext_fullpath(ext.name)
            bad = abi.libstdcxx_symbols(path)
            if bad:
                os.remove(path)
                raise RuntimeError(
                    f"prox: {os.path.basename(path)} defines {len(bad)} symbols of libstdc++'s runtime "
                    f"(e.g. {', '.join(bad[:3])}): {abi.ADVICE}. An extension built this way crashes (SIGSEGV) "
                    "on its first error message; the build was stopped instead.")

    inc = prox_include_dir()
    # sm_80 (A100 class) and sm_90a (H100/H200: the 'a' features prox's sm_90 paths use).
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
    csrc = HERE / "csrc"
    sources = [str(p.relative_to(HERE)) for p in sorted(csrc.glob("*.cu"))] + ["csrc/bindings.cpp"]
    ext = CUDAExtension(
        name="prox._C",
        sources=sources,
        include_dirs=[str(inc), str(csrc)],
        extra_link_args=link_args,
        extra_compile_args={
            # Hidden visibility, as prox's own symbols are (version.hpp): the module exports only PyInit__C,
            # and its classes may hold prox types as fields without GCC's -Wattributes.
            "cxx": ["-O3", "-std=c++17", "-fvisibility=hidden"],
            # The .cu files include prox, not torch: undo the half/bf16 operator bans torch adds for its
            # own headers, so prox compiles as its CMake build compiles it.
            "nvcc": ["-O3", "-std=c++17", "-Xcompiler", "-fvisibility=hidden", "-U__CUDA_NO_HALF_OPERATORS__",
                     "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                     "-U__CUDA_NO_HALF2_OPERATORS__"],
        },
    )
    setup(
        version=prox_version(inc),
        ext_modules=[ext],
        cmdclass={"build_ext": ProxBuildExt},
    )


main()
