"""Training: packed documents, the optimizer step on the mesh, checkpoints."""

from ..text import load_corpus, split_corpus
from .data import PackedStream
from .loop import TrainConfig, Trainer

__all__ = ["PackedStream", "load_corpus", "split_corpus", "TrainConfig", "Trainer"]
