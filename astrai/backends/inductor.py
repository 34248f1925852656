"""Functions compiled by ``torch.compile`` (inductor), lazily and per key; the toolchain probe.

The compiled rows (``rms_norm``'s and ``rotary``'s ``inductor``, ``attention``'s
``flex``) compile on their first call, never at import or table load.

``torch.compile`` keeps a function's compiled graphs on its code object and, past
``torch._dynamo.config.recompile_limit`` (8) graphs for one code object, runs it
uncompiled from then on. A row that serves many call signatures (dtypes, devices,
ranks, or for ``flex`` every shape) would reach that limit, so ``Compiled`` gives each
key a copy of the function with its own code object (same bytecode, its own cache)
and compiles that copy on the key's first call. Past ``max_keys`` keys, the one
compiled first is dropped (and compiled again if it comes back).

``inductor_available`` is the rows' probe. It checks the toolchain inductor needs
(a C++ compiler, found the way inductor looks for one; triton when a CUDA device is
present) without compiling anything: a compile costs seconds, and probes run in every
process that lists or explains the tables.
"""

from __future__ import annotations

__all__ = ["Compiled", "inductor_available"]

import importlib.util
import threading
import types
from collections.abc import Callable, Hashable
from typing import Any

import torch

from astrai.dispatch.tables.model import Unavailable


def _cxx_candidates() -> list[str]:
    """The compiler names inductor tries on this platform (``CXX``, else ``g++``/``clang++``)."""
    from torch._inductor import config  # already imported by ``import torch``

    cxx = config.cpp.cxx
    names = cxx if isinstance(cxx, (list, tuple)) else (cxx,)
    return [n for n in names if isinstance(n, str) and n]


def inductor_available() -> bool | Unavailable:
    """``True`` when inductor can build code here: a C++ compiler for CPU code that
    answers ``--version``, and triton when a CUDA device is present."""
    import subprocess  # here, not when the tables load: it costs milliseconds

    names = _cxx_candidates()
    for name in names:
        try:
            subprocess.run([name, "--version"], capture_output=True, check=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            continue
        break
    else:
        tried = ", ".join(names) or "none configured"
        return Unavailable(f"no C++ compiler for inductor's CPU code (tried: {tried}); "
                           "install g++ or set CXX")
    if torch.cuda.is_available() and importlib.util.find_spec("triton") is None:
        return Unavailable("a CUDA device is present but triton is not installed, so "
                           "inductor cannot compile CUDA calls (pip install triton)")
    return True


class Compiled:
    """``fn`` compiled by ``torch.compile`` on the first call of each key.

    ``compiled(key, *args)`` runs ``fn(*args)`` through the key's compiled copy;
    ``dynamic`` is ``torch.compile``'s (``True``: symbolic sizes, so lengths share a
    graph). ``fullgraph=True``: a graph break is an error, never a partial compile.
    ``backend`` is ``torch.compile``'s too (the rows use inductor; tests count graphs),
    and so are ``options`` (inductor's settings, e.g. ``emulate_precision_casts``: a
    cast to a lower precision inside the graph rounds as in eager mode, where inductor
    would otherwise keep float32 through it).
    """

    def __init__(self, fn: Callable[..., Any], *, dynamic: bool, max_keys: int = 32,
                 backend: Any = "inductor", options: dict[str, Any] | None = None) -> None:
        self.fn, self.dynamic, self.max_keys, self.backend = fn, dynamic, max_keys, backend
        self.options = options
        self._by_key: dict[Hashable, Callable[..., Any]] = {}
        self._lock = threading.Lock()

    def __call__(self, key: Hashable, *args: Any) -> Any:
        compiled = self._by_key.get(key)
        if compiled is None:
            compiled = self._add(key)
        return compiled(*args)

    def keys(self) -> list[Hashable]:
        """The keys compiled so far, oldest first."""
        return list(self._by_key)

    def clear(self) -> None:
        """Forget every compiled copy (each key compiles again on its next call)."""
        with self._lock:
            self._by_key.clear()

    def _add(self, key: Hashable) -> Callable[..., Any]:
        with self._lock:
            compiled = self._by_key.get(key)
            if compiled is None:
                fn = self.fn
                copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                                          fn.__defaults__, fn.__closure__)
                copy.__kwdefaults__ = fn.__kwdefaults__
                compiled = torch.compile(copy, dynamic=self.dynamic, fullgraph=True,
                                         backend=self.backend, options=self.options)
                while len(self._by_key) >= self.max_keys:
                    del self._by_key[next(iter(self._by_key))]
                self._by_key[key] = compiled
        return compiled

    def __repr__(self) -> str:
        return f"Compiled({self.fn.__qualname__}, dynamic={self.dynamic})"
