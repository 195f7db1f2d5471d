"""Calling a torch.compile'd function's graphs without torch.compile's entry at every call.

A call of a function compiled by torch.compile goes through torch.compile's entry: its Python wrapper (config and
hook contexts, the eval-frame switch), the lookup of the graph among those compiled for the function (each graph's
guards checked against the arguments), then the graph's code.  On a batch-1 decode step of a small model that entry
is ~60-100 us of a ~0.4 ms graph call on 2 CPU threads (measured: the same graph called both ways, outputs equal).

``CompiledDispatch`` keeps, per key the caller gives (a key that fixes everything the graphs' guards read: here the
step's row count, table width and band), the code torch.compile made for the graph that the guards chose for that
key the first time, and later calls of the key run that code directly, as vLLM's compiled models do (they call
the compiled code of their one graph and skip its guards).  The first call of a key goes through torch.compile
(compiling when no graph fits yet); the graph it ran is then found among the function's compiled graphs by checking
each one's guards against that call's arguments.  ``verify``: every direct call checks its graph's guards too (the
tests run so: a key that did not fix what the guards read would fail there).

Where the graphs cannot be listed (a torch without ``torch._dynamo.eval_frame._debug_get_cache_entry_list``, or a
graph that no guard check finds) every call goes through torch.compile, as without this class.
"""

from __future__ import annotations

import types
from typing import Callable, Hashable

import torch

__all__ = ["CompiledDispatch"]


class CompiledDispatch:
    """``dispatch(key, args)`` = ``compiled(*args)``: the graph a key's first call ran, called directly after it.

    compiled: a function made by ``torch.compile`` (one frame: no graph break in it, or the graphs after a break go
    through torch.compile's entry as usual).  Keys: hashable; the caller guarantees that two calls with one key
    pass the same graph's guards (shapes, dtypes, grad mode).  verify: check the guards at every direct call too
    (RuntimeError when they fail)."""

    verify = False  # (the test suite sets it for every instance: ``tests/conftest.py``)

    def __init__(self, compiled: Callable, verify: bool | None = None):
        self.compiled = compiled
        self.original = getattr(compiled, "_torchdynamo_orig_callable", None)
        if verify is not None:
            self.verify = verify
        self._direct: dict[Hashable, tuple[Callable, object]] = {}  # key -> (the graph's code as a function, guards)
        self.direct_calls = 0  # calls that skipped torch.compile's entry

    def __call__(self, key: Hashable, args: tuple):
        found = self._direct.get(key)
        if found is None:
            out = self.compiled(*args)
            found = self._graph_for(args)
            if found is not None:
                self._direct[key] = found
            return out
        function, guards = found
        if self.verify and not guards.check(self._locals(args)):
            raise RuntimeError(f"CompiledDispatch: the graph kept for key {key!r} does not accept these arguments")
        self.direct_calls += 1
        return function(*args)

    @property
    def keys(self) -> int:
        """Keys whose graph is called directly."""
        return len(self._direct)

    def _locals(self, args: tuple) -> dict:
        code = self.original.__code__
        return dict(zip(code.co_varnames[:code.co_argcount], args))

    def _graph_for(self, args: tuple) -> tuple[Callable, object] | None:
        """(the code of the compiled graph whose guards accept ``args``, its guards), or None."""
        entries = getattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
        if self.original is None or entries is None:
            return None
        try:
            local = self._locals(args)
            for entry in entries(self.original.__code__):
                code = entry.code
                if not code.co_freevars and entry.guard_manager.check(local):
                    return types.FunctionType(code, self.original.__globals__, code.co_name), entry.guard_manager
        except Exception:  # (torch's internals changed: every call keeps going through torch.compile)
            return None
        return None
