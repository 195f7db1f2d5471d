"""Chat templates rendered in a sandbox: jinja2's immutable sandbox, and (for a server) a process of its own.

A chat template comes with a downloaded checkpoint, so it is code the operator did not write: it may
loop for hours (``{% for i in range(10**5) %}{% for j in range(10**5) %}``) or build a gigabyte string.
``render_chat`` renders in jinja2's ``ImmutableSandboxedEnvironment`` (no attribute access to Python
internals, no mutation of the inputs).  A server runs it in this file as a separate process
(``python -I chat_template.py``; it imports jinja2 and the standard library only, so it starts in
milliseconds), whose address space is capped; the server kills and replaces the process when a render
outlasts its time limit (``serve.templates.TemplateWorkers``).

Protocol on stdin / stdout, one JSON object a line:
    -> {"template": str, "bos_token": str, "eos_token": str}               (first line: the template)
    -> {"messages": [...], "add_generation_prompt": bool, "tools": [...]?}   (then one per request)
    <- {"text": str}  or  {"error": str}
"""

from __future__ import annotations

import json
import sys

__all__ = ["render_chat", "compile_template"]

_TEMPLATES: dict[str, object] = {}


def compile_template(source: str):
    """A sandboxed jinja2 template, cached by source."""
    if source not in _TEMPLATES:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]


def render_chat(source: str, messages: list[dict], add_generation_prompt: bool = True, bos_token: str = "",
                eos_token: str = "", tools: list | None = None) -> str:
    """The prompt text of OpenAI-style ``messages`` ({"role", "content"} dicts) through the template;
    ``tools`` (OpenAI's function definitions) reach it as ``tools``, as transformers passes them."""
    return compile_template(source).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                           bos_token=bos_token, eos_token=eos_token, tools=tools)


def _cap_memory(nbytes: int) -> None:
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (nbytes, nbytes))
    except (ImportError, ValueError, OSError):  # not on every platform: the time limit still holds
        pass


def main() -> None:
    """Serve render requests on stdin / stdout until stdin closes."""
    memory = int(sys.argv[1]) if len(sys.argv) > 1 else 2**31
    setup = json.loads(sys.stdin.readline())
    source, bos, eos = setup["template"], setup.get("bos_token") or "", setup.get("eos_token") or ""
    _cap_memory(memory)
    for line in sys.stdin:
        try:
            ask = json.loads(line)
            reply = {"text": render_chat(source, ask["messages"], ask.get("add_generation_prompt", True), bos, eos,
                                         ask.get("tools"))}
        except MemoryError:
            reply = {"error": "the chat template ran out of memory"}
        except RecursionError:
            reply = {"error": "the chat template recursed too deeply"}
        except Exception as error:  # the template's own errors (raise_exception), bad input, sandbox refusals
            reply = {"error": f"{type(error).__name__}: {error}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
