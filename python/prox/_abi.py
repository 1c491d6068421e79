# SPDX-License-Identifier: Apache-2.0
"""The C++ runtime the extension links: one libstdc++ per process.

A compiler that finds ``libstdc++.a`` before ``libstdc++.so`` (a relocated GCC such as the GPU image's
/opt/gcc/bin/g++) links parts of libstdc++ statically into ``prox/_C*.so``. The process then holds two C++
runtimes, torch's shared one and the copy inside the extension, with different locale facet indices, and
the first ``TORCH_CHECK`` that formats an integer (``ostream << long``) calls into the wrong facet and dies
with SIGSEGV (GCC bug 67903 describes the mechanism). setup.py links the shared libstdc++ that torch's
process loads (``loaded_libstdcxx()``) and refuses a build whose extension still defines libstdc++'s
symbols (``libstdcxx_symbols()``); the tests check the installed extension the same way.

This module imports nothing from prox (setup.py loads it by path, before the package exists).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Optional

#: Mangled-name prefixes only libstdc++'s compiled runtime defines: std::ostream / std::istream, the
#: standard streams, std::ios_base, locales and their facets, the C++ ABI support (__cxa_*, the
#: personality routine) and the replaceable operators new / delete. An extension that defines any of them
#: carries its own copy of the runtime. (Not every std:: symbol: a correctly linked extension may define
#: weak copies of inline members, e.g. std::__cxx11::basic_stringbuf's destructors.)
LIBSTDCXX_PREFIXES = (
    "_ZNSo", "_ZNKSo", "_ZNSi", "_ZNKSi", "_ZSt4cout", "_ZSt4cerr", "_ZSt4clog", "_ZSt3cin",
    "_ZNSt6locale", "_ZNKSt6locale", "_ZNSt8ios_base", "_ZNKSt8ios_base",
    "_ZNSt7codecvt", "_ZNKSt7codecvt", "_ZNSt5ctype", "_ZNKSt5ctype", "_ZNSt7num_put", "_ZNKSt7num_put",
    "_ZNSt7num_get", "_ZNKSt7num_get", "_ZNSt8numpunct", "_ZNKSt8numpunct",
    "__cxa_", "__gxx_personality_v0", "_Znwm", "_Znam", "_ZdlPv", "_ZdaPv",
)
_PATTERN = re.compile("^(?:" + "|".join(re.escape(p) for p in LIBSTDCXX_PREFIXES) + ")")

#: What to do about it, in every message that reports it.
ADVICE = ("the compiler linked a static libstdc++ into the extension (it finds libstdc++.a before libstdc++.so, "
          "as a relocated GCC such as /opt/gcc/bin/g++ does); build with the system compiler: "
          "CC=/usr/bin/gcc CXX=/usr/bin/g++ pip install ./python --no-build-isolation")


def loaded_libstdcxx() -> Optional[str]:
    """The path of the libstdc++.so.6 this process has loaded (torch's), from /proc/self/maps; None where
    there is none or no /proc (then the compiler's default applies)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.rstrip("\n").split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
                if os.path.basename(path).startswith("libstdc++.so") and os.path.isfile(path):
                    return os.path.realpath(path)
    except OSError:
        return None
    return None


def defined_dynamic_symbols(path: str) -> list[str]:
    """The dynamic symbols a shared object defines (``nm -D --defined-only``)."""
    nm = shutil.which("nm")
    if nm is None:
        raise RuntimeError("prox: `nm` (binutils) is needed to check the extension's C++ runtime")
    out = subprocess.run([nm, "-D", "--defined-only", path], capture_output=True, text=True, check=True).stdout
    return [line.split()[-1] for line in out.splitlines() if line.strip() and len(line.split()) >= 3]


def libstdcxx_symbols(path: str) -> list[str]:
    """The libstdc++ runtime symbols ``path`` defines (empty for a correctly linked extension)."""
    return [s for s in defined_dynamic_symbols(path) if _PATTERN.match(s.split("@")[0])]
