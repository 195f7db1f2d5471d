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
