"""``CompiledDispatch``: a compiled function's graphs called without torch.compile's entry after a key's first
call.  The outputs equal torch.compile's call of the same arguments (and the function's eager value), each key
runs the graph torch.compile chose for it, and with ``verify`` a key reused for arguments its graph's guards refuse
raises instead of running the wrong graph."""

from __future__ import annotations

import itertools
import types

import pytest
import torch

from ringmoe.serve.compiled_dispatch import CompiledDispatch


def _step(x, table, scale):
    """A graph per form: one row (specialised by torch.compile), and more rows, whose form switches at 4."""
    y = (x @ table.T) * scale
    if x.shape[0] >= 4:
        return torch.relu(y).sum(-1)
    return y.tanh().sum(-1)


_COPIES = itertools.count()


def _compiled():
    """``_step`` compiled, as a copy with its own code object: its own graphs (no other test's)."""
    code = _step.__code__.replace(co_name=f"_step_{next(_COPIES)}")
    function = types.FunctionType(code, _step.__globals__, code.co_name)
    return function, torch.compile(function, dynamic=True, options={"cpp_wrapper": True})


def _inputs(rows: int, width: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 8, generator=gen, dtype=torch.float64), torch.randn(width, 8, generator=gen,
                                                                               dtype=torch.float64), 0.5


def test_direct_calls_equal_torch_compile_and_eager():
    function, compiled = _compiled()
    dispatch = CompiledDispatch(compiled, verify=True)
    seed = 0
    for rounds in range(3):
        for rows, width in ((1, 3), (2, 3), (3, 5), (4, 3), (7, 5)):
            seed += 1
            args = _inputs(rows, width, seed)
            got = dispatch((rows, width), args)
            torch.testing.assert_close(got, _step(*args), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(got, compiled(*args), rtol=0, atol=0)
        # every key's graph was found after its first call, and the later rounds ran them directly
        assert dispatch.keys == 5 and dispatch.direct_calls == 5 * rounds
    assert len(torch._dynamo.eval_frame._debug_get_cache_entry_list(function.__code__)) == 3


def test_verify_refuses_a_key_whose_graph_does_not_fit():
    _, compiled = _compiled()
    dispatch = CompiledDispatch(compiled, verify=True)
    dispatch("same key", _inputs(2, 3, 1))
    dispatch("same key", _inputs(3, 3, 2))  # the same graph's guards accept three rows
    with pytest.raises(RuntimeError, match="does not accept"):
        dispatch("same key", _inputs(5, 3, 3))  # five rows: the other form's graph
    unchecked = CompiledDispatch(compiled, verify=False)
    unchecked("k", _inputs(2, 3, 4))
    args = _inputs(5, 3, 5)  # unchecked, the kept graph runs: what verify is for
    assert not torch.allclose(unchecked("k", args), _step(*args))
