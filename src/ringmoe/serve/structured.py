"""Structured outputs: the output must follow a grammar, enforced by masking the logits before sampling.

    backend = GrammarBackend(tokenizer, vocab_size=model.config.vocab_size, stop_ids=engine.eos_ids)
    grammar = backend.compile(GrammarSpec("json_schema", json.dumps(schema)))   # cached; ValueError if invalid
    SamplingParams(grammar=grammar, ...)                                         # the engine does the rest

xgrammar does the work (vLLM's and SGLang's default backend): the tokenizer's vocabulary is handed over
once (``TokenizerInfo``), each grammar is compiled once (an LRU of compiled grammars keyed by the spec),
each request holds a ``Matcher`` (its position in the grammar), and every engine step fills the token
bitmasks of all constrained requests at once (``grammar_masks``), turning them into an additive (rows,
vocab) float32 mask: 0 where a token is allowed, -inf where it is not.  When the grammar is complete
the only tokens allowed are the end-of-sequence ids, so a constrained request ends by itself.

JSON grammars are compact by default (no whitespace between JSON tokens: xgrammar's
``any_whitespace=False``, SGLang's ``--constrained-json-disable-any-whitespace``), so a weak model cannot
wander in whitespace until ``max_tokens``; ``any_whitespace=True`` allows it.  xgrammar is an optional
dependency, imported when the first backend is built.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

__all__ = ["GrammarSpec", "GrammarBackend", "CompiledGrammar", "Matcher", "grammar_masks", "KINDS"]

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must be.  kind: one of KINDS; source: the JSON schema (JSON text), the regular
    expression, the choices (a JSON list of strings), the EBNF grammar, or the structural tag (JSON text);
    json_object has none."""

    kind: str
    source: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind must be one of {KINDS}, got {self.kind!r}")


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, matcher):
        self._matcher = matcher

    def advance(self, token: int) -> bool:
        """Take the sampled token; True when the grammar is now finished (its end-of-sequence accepted)."""
        if not self._matcher.accept_token(token):
            raise ValueError(f"token {token} does not follow the request's grammar")
        return self._matcher.is_terminated()


class CompiledGrammar:
    """A grammar compiled against the served vocabulary; ``matcher()`` starts a request at its beginning."""

    def __init__(self, spec: GrammarSpec, compiled):
        self.spec, self._compiled = spec, compiled
        self._serialized: str | None = None

    def matcher(self) -> Matcher:
        import xgrammar

        return Matcher(xgrammar.GrammarMatcher(self._compiled))

    def serialized(self) -> str:
        """xgrammar's JSON of the compiled grammar (``GrammarBackend.load`` reads it back in another process).  Its
        size can far exceed the grammar's memory: a schema of arrays nested 240 deep (15 KB of JSON) serializes to
        48 MB in ~4 s, and loading that back takes ~1 s (measured, a 384-token vocabulary)."""
        return self._serialized if self._serialized is not None else self._compiled.serialize_json()

    def for_sending(self) -> "CompiledGrammar":
        """A copy holding its serialized form, made now (in a worker thread: the copy one request takes to an
        engine-core process, so the event loop never serializes and the cache keeps no copy of the text)."""
        copy = CompiledGrammar(self.spec, self._compiled)
        copy._serialized = self._compiled.serialize_json()
        return copy

    def __repr__(self) -> str:
        return f"CompiledGrammar({self.spec.kind})"


class GrammarBackend:
    """xgrammar over one tokenizer: compiles grammars (thread-safe, cached) for ``SamplingParams.grammar``.

    tokenizer: a ``text.Tokenizer``.  vocab_size: the model's logit width (may exceed the tokenizer's).
    stop_ids: the end-of-sequence ids that end a finished grammar.  any_whitespace: let JSON grammars
    put whitespace between tokens (off by default).  cache_size: compiled grammars kept."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids, any_whitespace: bool = False, cache_size: int = 256):
        import xgrammar

        vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
        encoded = [""] * vocab_size
        for text, index in vocab.items():
            if index < vocab_size:
                encoded[index] = text
        metadata = xgrammar.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend.to_str())
        stop_ids = [int(t) for t in stop_ids if 0 <= t < vocab_size]
        if not stop_ids:
            raise ValueError("structured outputs need an end-of-sequence id (generation_config.json eos_token_id)")
        info = xgrammar.TokenizerInfo(encoded, metadata["vocab_type"], vocab_size=vocab_size, stop_token_ids=stop_ids,
                                      add_prefix_space=metadata["add_prefix_space"])
        self.tokenizer_info = info
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        self.any_whitespace, self.cache_size = any_whitespace, cache_size
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar of ``spec`` (from the cache when seen before); ValueError when it is invalid."""
        cached = self._cached(spec)
        if cached is not None:
            return cached
        try:
            compiled = CompiledGrammar(spec, self._compile(spec))
        except ValueError:
            raise
        except Exception as error:  # xgrammar's own errors (RuntimeError, InvalidJSONError...) name the problem
            raise ValueError(f"invalid {spec.kind}: {str(error).splitlines()[0] if str(error) else error!r}") from None
        self._remember(spec, compiled)
        return compiled

    def load(self, spec: GrammarSpec, serialized: str) -> CompiledGrammar:
        """A grammar another process compiled against the same vocabulary (``CompiledGrammar.serialized``),
        kept in the same cache; ValueError when the JSON is not a compiled grammar."""
        import xgrammar

        cached = self._cached(spec)
        if cached is not None:
            return cached
        try:
            compiled = CompiledGrammar(spec, xgrammar.CompiledGrammar.deserialize_json(serialized, self.tokenizer_info))
        except Exception as error:
            raise ValueError(f"invalid compiled {spec.kind} grammar: {error}") from None
        self._remember(spec, compiled)
        return compiled

    def _cached(self, spec: GrammarSpec) -> CompiledGrammar | None:
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        return None

    def _remember(self, spec: GrammarSpec, compiled: CompiledGrammar) -> None:
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def _compile(self, spec: GrammarSpec):
        import xgrammar

        compiler, whitespace = self.compiler, self.any_whitespace
        if spec.kind == "json_schema":
            return compiler.compile_grammar(json_schema_ebnf(spec.source, whitespace))
        if spec.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=whitespace)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.source)
        if spec.kind == "choice":
            choices = json.loads(spec.source)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            # an EBNF alternation of string literals: JSON's string escapes are EBNF's
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
        if spec.kind == "grammar":
            return compiler.compile_grammar(spec.source)
        tag = json.loads(spec.source)
        if not whitespace:
            tag = _compact(tag)
        return compiler.compile_structural_tag(xgrammar.StructuralTag.model_validate(tag))


# xgrammar (0.2.9) writes the characters of a string with minLength / maxLength as [^"\\\r\n], which lets
# control characters (a raw tab, \x15) into a JSON string: invalid JSON.  Its unbounded strings exclude them.
_BOUNDED_CHAR = '([^\\"\\\\\\r\\n])'
_JSON_CHAR = '([^\\0-\\x1f\\"\\\\\\r\\n])'


def json_schema_ebnf(schema: str, any_whitespace: bool) -> str:
    """The EBNF grammar of a JSON schema (strict: no properties beyond the schema's), its string characters
    always valid JSON."""
    import xgrammar

    grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=any_whitespace, strict_mode=True)
    return str(grammar).replace(_BOUNDED_CHAR, _JSON_CHAR)


def _compact(node):
    """A structural tag whose JSON-schema parts allow no whitespace between JSON tokens (xgrammar's structural
    tags take any whitespace there: each part becomes the EBNF of its schema compiled with any_whitespace off)."""
    if isinstance(node, list):
        return [_compact(item) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and "json_schema" in node:
        schema = node["json_schema"]
        return {"type": "grammar", "grammar": json_schema_ebnf(schema if isinstance(schema, str) else json.dumps(schema),
                                                               False)}
    return {key: _compact(value) for key, value in node.items()}


def grammar_masks(matchers: list, vocab_size: int) -> list[torch.Tensor | None]:
    """One additive (vocab_size,) float32 mask per matcher (None where a request has no grammar): the
    bitmasks of the whole step are filled together and expanded in one call."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    masks: list[torch.Tensor | None] = [None] * len(matchers)
    if not rows:
        return masks
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(rows), vocab_size)
    for slot, row in enumerate(rows):
        matchers[row]._matcher.fill_next_token_bitmask(bitmask, slot)
    additive = torch.zeros(len(rows), vocab_size, dtype=torch.float32)
    xgrammar.apply_token_bitmask_inplace(additive, bitmask, vocab_size=vocab_size)
    for slot, row in enumerate(rows):
        masks[row] = additive[slot]
    return masks
