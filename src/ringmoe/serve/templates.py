"""Chat-template rendering for the server: worker processes with a time limit, off the event loop.

``TemplateWorkers(template, bos, eos, workers=2, timeout_s=5)`` starts ``workers`` processes running
``text/chat_template.py`` (jinja2 only, address space capped).  ``await render(messages)`` hands the
messages to an idle worker and waits for its line; a render that outlasts ``timeout_s`` raises
``TemplateTimeout`` and its process is killed and replaced, so a template that loops forever costs
one request its answer (a 400) and nothing else: the event loop never runs template code.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from ..text import chat_template

__all__ = ["TemplateWorkers", "TemplateTimeout", "TemplateFailed"]

_SCRIPT = Path(chat_template.__file__)  # run as a script: it imports jinja2 and the standard library only


class TemplateTimeout(RuntimeError):
    """The chat template did not finish within the time limit."""


class TemplateFailed(ValueError):
    """The chat template raised (raise_exception, a sandbox refusal, bad messages)."""


class TemplateWorkers:
    def __init__(self, template: str, bos_token: str = "", eos_token: str = "", workers: int = 2,
                 timeout_s: float = 5.0, memory_bytes: int = 2**31, line_limit: int = 2**28):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.setup = json.dumps({"template": template, "bos_token": bos_token, "eos_token": eos_token}) + "\n"
        self.workers, self.timeout_s = workers, timeout_s
        self.memory_bytes, self.line_limit = memory_bytes, line_limit
        self._idle: asyncio.Queue | None = None
        self._all: set = set()
        self.restarts = 0  # processes killed for a render over the limit

    async def start(self) -> "TemplateWorkers":
        self._idle = asyncio.Queue()
        for _ in range(self.workers):
            self._idle.put_nowait(await self._spawn())
        return self

    async def _spawn(self):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", str(_SCRIPT), str(self.memory_bytes), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, limit=self.line_limit)
        proc.stdin.write(self.setup.encode())
        await proc.stdin.drain()
        self._all.add(proc)
        return proc

    async def _kill(self, proc) -> None:
        self._all.discard(proc)
        if proc.returncode is None:
            proc.kill()
        await proc.wait()

    async def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None) -> str:
        """The prompt text (``tools``: OpenAI's function definitions, as transformers hands them to templates);
        TemplateTimeout past the limit, TemplateFailed when the template raises."""
        proc = await self._idle.get()
        healthy = False
        try:
            ask = {"messages": messages, "add_generation_prompt": add_generation_prompt, "tools": tools}
            proc.stdin.write((json.dumps(ask) + "\n").encode())
            await proc.stdin.drain()
            line = await asyncio.wait_for(proc.stdout.readline(), self.timeout_s)
            if not line:
                raise TemplateFailed("the chat template worker stopped (out of memory?)")
            reply = json.loads(line)
            healthy = True
        except asyncio.TimeoutError:
            self.restarts += 1
            raise TemplateTimeout(f"the chat template took longer than {self.timeout_s:g} s") from None
        except (ValueError, OSError) as error:  # a reply line over the limit, a broken pipe
            if isinstance(error, TemplateFailed):
                raise
            raise TemplateFailed(f"the chat template's output could not be read: {error}") from None
        finally:
            if healthy:
                self._idle.put_nowait(proc)
            else:  # killed or broken: replace it (a fresh process starts in milliseconds)
                await self._kill(proc)
                self._idle.put_nowait(await self._spawn())
        if "error" in reply:
            raise TemplateFailed(reply["error"])
        return reply["text"]

    async def close(self) -> None:
        for proc in list(self._all):
            await self._kill(proc)
