"""Serving: requests, sampling, tokenizer, paged KV cache, scheduler, runner, engine."""

from .engine import Engine, StepStats
from .kv_cache import BlockManager
from .request import RequestOutput
from .sampling import SamplingParams
from .scheduler import Scheduler
from .tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["Engine", "StepStats", "BlockManager", "RequestOutput", "SamplingParams", "Scheduler", "Tokenizer",
           "IncrementalDetokenizer"]
