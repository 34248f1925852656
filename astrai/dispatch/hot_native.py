"""The compiled hot path as the engine takes it up: what a loaded native extension
(``astrai.native``, which knows no engine) is handed - the process state it reads the
snapshot and the facades' worlds from, the scope variable, the environment's raw dict and
``ASTR_OPS``'s key, the tensor types - once its opcodes are checked to be
``astrai.dispatch.reading``'s. Importing this module registers that setup with the
loader; ``load``, ``pending`` and ``status`` are the loader's."""

from __future__ import annotations

__all__ = ["load", "pending", "status"]

from types import ModuleType

import torch

from astrai import native
from astrai.dispatch import state as process
from astrai.dispatch.reading import GUARDS, ITEMS, VALUES
from astrai.dispatch.scopes import scope_variable
from astrai.env import ENVIRON_DATA, OPS_KEY

load, pending, status = native.load, native.pending, native.status


def _setup(module: ModuleType) -> None:
    if ENVIRON_DATA is None:  # pragma: no cover - platforms without os.environ._data
        raise ImportError("this platform's os.environ has no raw dict to read")
    if module.opcodes() != (GUARDS, VALUES, ITEMS):
        raise ImportError("the built extension reads other opcodes than "
                          "astrai.dispatch.reading names: rebuild it")
    module.setup(vars(process), scope_variable(), ENVIRON_DATA, OPS_KEY, torch.Tensor,
                 torch.nn.Parameter)


native.add_setup(_setup)
