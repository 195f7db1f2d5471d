"""Training: packed documents, the optimizer step on the mesh, checkpoints."""

from .data import PackedStream, load_corpus, split_corpus
from .loop import TrainConfig, Trainer

__all__ = ["PackedStream", "load_corpus", "split_corpus", "TrainConfig", "Trainer"]
