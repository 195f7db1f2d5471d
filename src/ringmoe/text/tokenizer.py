"""A checkpoint's tokenizer: `tokenizers` for the vocabulary, jinja2 for the chat template.

Reads ``tokenizer.json`` (any model the `tokenizers` library loads), ``tokenizer_config.json``
(special tokens, ``chat_template``) or ``chat_template.jinja``, and the end-of-sequence ids from
``generation_config.json`` (falling back to config.json and the tokenizer's eos token).

``IncrementalDetokenizer`` turns a growing list of ids into text deltas without ever emitting a
broken UTF-8 character: byte-level BPE splits multi-byte characters across tokens, and a
partial character decodes to U+FFFD, so text is held back while it ends in one.
"""

from __future__ import annotations

from pathlib import Path

from ..jsonio import read_json
from .chat_template import render_chat

__all__ = ["Tokenizer", "IncrementalDetokenizer"]


class Tokenizer:
    def __init__(self, folder: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{str(folder)!r} has no tokenizer.json")
        try:
            self.backend = HFTokenizer.from_file(str(path))
        except Exception as error:
            raise ValueError(f"{str(path)!r} is not a tokenizer the tokenizers library can load: {error}") from None
        config = read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        template = config.get("chat_template")
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template = template
        self.eos_token_ids = self._eos_ids(folder)
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)

    def _eos_ids(self, folder: Path) -> tuple[int, ...]:
        for name in ("generation_config.json", "config.json"):
            if (folder / name).is_file():
                value = read_json(folder / name).get("eos_token_id")
                if value is not None:
                    return tuple(value) if isinstance(value, list) else (int(value),)
        if self.eos_token is not None and self.backend.token_to_id(self.eos_token) is not None:
            return (self.backend.token_to_id(self.eos_token),)
        return ()

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        """Token ids of ``text``.  Releases the GIL while it works (``encode`` of the tokenizers library holds
        it; ``encode_batch`` does not), so a server thread tokenizing a long prompt stalls no other thread.

        max_tokens: ValueError when the text has more tokens, raised before the ids become a Python list (for
        a million tokens that conversion alone holds the GIL for tens of milliseconds)."""
        encoding = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        if max_tokens is not None and len(encoding) > max_tokens:
            raise ValueError(f"the text has {len(encoding)} tokens, more than {max_tokens}")
        return encoding.ids

    def min_tokens(self, text: str) -> int:
        """A floor on len(encode(text)) that costs nothing: one token's vocabulary entry spans at most its own
        length in characters of the input (byte-level BPE: one character per byte; Metaspace: one per
        character), so a text holds at least len(text) / (longest entry) tokens; a normalizer may expand
        characters (NFKC), hence a margin of 4 when there is one."""
        if not hasattr(self, "_longest_entry"):
            self._longest_entry = max((len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)
        margin = 1 if self.backend.normalizer is None else 4
        return len(text) // (self._longest_entry * margin)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for a chat (OpenAI-style ``messages``) through the checkpoint's template."""
        if not self.chat_template:
            raise ValueError("this checkpoint has no chat template (tokenizer_config.json chat_template or "
                             "chat_template.jinja)")
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValueError(f"messages[{index}] must be an object with a string 'role'")
        return render_chat(self.chat_template, messages, add_generation_prompt, self.bos_token or "",
                           self.eos_token or "")


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised as a dict
        return value.get("content")
    return value


class IncrementalDetokenizer:
    """Text deltas of a growing token list; never splits a UTF-8 character.

    Decodes a short window of recent tokens (prefix_offset:) and emits what it adds beyond the
    text already emitted, as long as the new text does not end in U+FFFD (a partial character).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] = (), skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids = list(prompt_ids[-6:])  # a little context so leading spaces decode as in the full text
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token: int) -> str:
        """Append one token id; the new text it completes (possibly empty)."""
        self.ids.append(token)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back at the end of the stream (a dangling partial character included)."""
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], self.skip)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        delta = full[len(prefix):] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
