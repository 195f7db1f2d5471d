"""Text: tokenizers, chat templates and corpora, below both serving and training."""

from .bpe import CHAT_TEMPLATE, SPECIAL, train_tokenizer
from .chat_template import render_chat
from .corpus import load_corpus, split_corpus, stdlib_texts
from .tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["Tokenizer", "IncrementalDetokenizer", "render_chat", "train_tokenizer", "SPECIAL", "CHAT_TEMPLATE",
           "load_corpus", "split_corpus", "stdlib_texts"]
