"""Serving: requests, sampling, paged KV cache, scheduler, runner, engine (and ``generate`` on it), HTTP server."""

from .engine import Engine, StepStats
from .generate import Generation, generate
from .kv_cache import BlockManager
from .request import RequestOutput
from .sampling import SamplingParams
from .scheduler import Scheduler

__all__ = ["Engine", "StepStats", "generate", "Generation", "BlockManager", "RequestOutput", "SamplingParams",
           "Scheduler"]
