"""Serving fixtures: a small served checkpoint (a tiny Mixtral written by transformers with a real byte-level BPE
tokenizer trained on the fly by the library's ``train_tokenizer``, a ChatML template and generation_config's
end-of-sequence id), and ``Server``: ``ringmoe serve`` as a live process on a free 127.0.0.1 port, stopped by
its PID (its ranks are its children)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from ringmoe.text import train_tokenizer

CORPUS = ["def add(a, b):\n    return a + b\n", "naïve café — 東京 🚀 déjà vu", "print('hello, world')\n",
          "for i in range(10):\n    total += i * i\n", "Größe: 12 €, ½ kg 🍣🍣",
          "The quick brown fox jumps over the lazy dog.", "Serving mixture-of-experts models across ranks."] * 20


def write_tokenizer(path) -> int:
    """A byte-level BPE of 384 tokens trained on CORPUS (ChatML template, EOS <|im_end|>); its vocabulary size."""
    from tokenizers import Tokenizer

    train_tokenizer(CORPUS, 384, path)
    return Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()


@pytest.fixture(scope="session")
def served_checkpoint(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    path = tmp_path_factory.mktemp("served")
    vocab = write_tokenizer(path)
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                     intermediate_size=96, initializer_range=0.1)
    eos = json.loads((path / "generation_config.json").read_text())
    transformers.MixtralForCausalLM(cfg).save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps(eos))  # save_pretrained writes its own
    return path


HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]


@pytest.fixture(scope="session")
def harmony_checkpoint(tmp_path_factory):
    """The served checkpoint's tokenizer plus gpt-oss's harmony special tokens; <|call|> and <|return|> end a turn."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    path = tmp_path_factory.mktemp("harmony")
    write_tokenizer(path)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.add_special_tokens(HARMONY_TOKENS)
    tokenizer.save(str(path / "tokenizer.json"))
    ends = [tokenizer.token_to_id("<|return|>"), tokenizer.token_to_id("<|call|>")]
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, intermediate_size=96, initializer_range=0.1)
    transformers.MixtralForCausalLM(config).save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    return path


MODEL = "tiny-moe"


def metric(url: str, name: str) -> float:
    """A Prometheus metric of the server at ``url``, summed over its labels."""
    import httpx

    text = httpx.get(f"{url}/metrics").text
    return sum(float(x) for x in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M))


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def descendants(pid: int) -> list[int]:
    found = []
    for child in children(pid):
        found += [child] + descendants(child)
    return found


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


class Server:
    """`ringmoe serve` on a free port; ``client`` is the official openai client pointed at it."""

    def __init__(self, checkpoint, cp=1, ep=1, *extra, api_key: str | None = None, env: dict | None = None,
                 compiled: bool = False):
        """compiled: keep the compiled decode graph (compiled at start-up: slower to come up); by default the
        test servers run eagerly (--enforce-eager) so the suite does not compile a graph per server."""
        import openai

        from ringmoe.parallel.launch import free_port
        from ringmoe.serve.bench import wait_healthy

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty server can never block on it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ringmoe.cli", "serve", "--model", str(checkpoint), "--port", str(self.port),
             "--served-model-name", MODEL, "--cp", str(cp), "--ep", str(ep), "--kv-cache-tokens", "4096", *extra]
            + ([] if compiled else ["--enforce-eager"])
            + (["--api-key", api_key] if api_key else []),
            stdout=subprocess.DEVNULL, stderr=self.log, text=True, start_new_session=True,
            env={**os.environ, **(env or {})})
        try:
            wait_healthy(self.url, self.proc, 300 if compiled else 90)
        except RuntimeError as error:
            _, err = self.stop()
            raise RuntimeError(f"{error}\n{err[-3000:]}") from None
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key or "none", max_retries=0, timeout=60)

    def stderr(self) -> str:
        """What the server has written to stderr so far (its logs)."""
        self.log.seek(0)
        text = self.log.read()
        self.log.seek(0, 2)
        return text

    def engine_process(self) -> int | None:
        """The engine-core process (--engine-core process, the default); None when the engine is a thread."""
        return next((p for p in descendants(self.proc.pid) if comm(p) == "ringmoe-engine"), None)

    def frontends(self) -> list[int]:
        """The HTTP front-end processes (--engine-core process)."""
        return sorted((p for p in children(self.proc.pid) if comm(p).startswith("ringmoe-api-")),
                      key=lambda p: comm(p))

    def ranks(self) -> list[int]:
        """A mesh's rank processes (the engine process's children, or the server's with --engine-core thread)."""
        engine = self.engine_process()
        return children(engine) if engine is not None else children(self.proc.pid)

    def stop(self) -> tuple[int, str]:
        everything = [self.proc.pid] + descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        err = self.stderr()
        for pid in everything:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return self.proc.returncode, err


def served_greedy_texts(checkpoint, flags: tuple[str, ...], prompts: list[str], max_tokens: int) -> list[str]:
    """The greedy completions (ignore_eos) of ``prompts`` from `ringmoe serve <flags>` on one rank, through the
    openai client; the server is stopped before returning."""
    server = Server(checkpoint, 1, 1, *flags)
    try:
        return [server.client.completions.create(model=MODEL, prompt=p, max_tokens=max_tokens, temperature=0,
                                                 extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    finally:
        server.stop()
