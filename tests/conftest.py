"""Test-session setup.

Triton kernels run on the CPU through Triton's interpreter, which Triton
switches on with TRITON_INTERPRET=1 when its kernels are defined: set it
before anything imports them.  The library never picks Triton on CPU tensors
by itself ("auto" uses Triton only for CUDA tensors), so this affects only
tests that ask for backend="triton".
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

# session fixtures for tests/serve and tests/security
from .served import harmony_checkpoint, served_checkpoint  # noqa: E402,F401

import pytest  # noqa: E402

from ringmoe.serve.compiled_dispatch import CompiledDispatch  # noqa: E402

# every direct call of a compiled decode graph also checks that graph's guards (a key that does not fix what they
# read fails the test that meets it; spawned ranks set it themselves)
CompiledDispatch.verify = True

# parametrized cases too long for `make test` (they run in `make test-all`): the 2 x 2 mesh server's load tests
SLOW_CASES = {
    "tests/serve/test_server.py::test_bounded_load_without_errors[2x2]",
    "tests/serve/test_server.py::test_without_max_tokens_a_long_prompt_gets_what_the_context_leaves[2x2]",
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in SLOW_CASES:
            item.add_marker(pytest.mark.slow)
