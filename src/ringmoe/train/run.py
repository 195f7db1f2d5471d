"""`ringmoe train`: a corpus in, a transformers checkpoint (and resumable training state) out.

The parent process prepares everything a rank needs before any rank starts: the corpus (the
standard library's sources by default), its train / validation split, a byte-level BPE tokenizer
trained on the training documents (``out/tokenizer``; reused on --resume) and the tokenized documents.
Then the ranks (a local cp x ep mesh, or one process) train: every ``eval_every`` steps the validation
loss, every ``save_every`` steps and at the end a checkpoint (``out/step-N``), and at the end the
transformers export (``out/hf``: config.json, model.safetensors, tokenizer files), the metrics as JSONL
(``out/metrics.jsonl``) and a PNG of the loss curves (``out/loss.png``).  Rank 0 decides when to stop
(``steps`` reached or ``minutes`` spent) and tells the others each step.
"""

from __future__ import annotations

import json
import queue
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..model import MoETransformer, preset
from ..parallel import make_mesh
from ..parallel.launch import join_torchrun, spawn
from ..parallel.layout import LAYOUTS
from ..parallel.ulysses import check_heads
from ..text import Tokenizer, load_corpus, split_corpus, train_tokenizer
from ..text.bpe import MIN_VOCAB
from . import checkpoint
from .data import PackedStream, unigram_entropy
from .loop import TrainConfig, Trainer

__all__ = ["TrainOptions", "run_training", "model_config", "sequence_split"]


@dataclass
class TrainOptions:
    out: str
    data: str | None = None
    preset: str = "small"
    vocab_size: int | None = None       # default: the preset's
    cp: int = 1
    ep: int = 1
    seqlen: int = 512
    tokens_per_step: int = 8192
    steps: int = 200
    minutes: float | None = None
    lr: float = 3e-3
    warmup: int = 20
    balance: str = "aux"
    aux_coef: float = 1e-2              # weight of the Switch balancing loss (balance="aux")
    bias_rate: float = 1e-3             # step of the selection bias per update (balance="bias")
    mtp: bool = False                   # train a DeepSeek-V3 multi-token prediction module with the model
    mtp_lambda: float = 0.3             # the MTP loss's weight
    clip: float = 1.0
    seed: int = 0
    eval_every: int = 50
    eval_sequences: int = 16
    save_every: int = 100
    resume: bool = False
    layout: str = "zigzag"
    cp_mode: str = "ring"               # ring | ulysses | usp (with ulysses_degree); the CLI resolves "auto"
    ulysses_degree: int | None = None   # --cp-mode usp: the Ulysses part of cp (the ring is cp / it)
    bf16: bool = False
    activation_checkpointing: bool = False
    peak_flops: float = 1.6e11          # this 2-core CPU's measured sgemm peak; MFU is relative to it
    max_bytes: int = 4_000_000
    log_every: int = 1                  # print every n-th step (and every evaluation)

    @property
    def rows(self) -> int:
        return self.tokens_per_step // self.seqlen


CP_MODES = ("ring", "ulysses", "usp")


def sequence_split(options: TrainOptions) -> tuple[int, str]:
    """(the Ulysses degree of the cp group, why): ring 1, ulysses cp, usp --ulysses-degree.  (`ringmoe train
    --cp-mode auto` asks the cost model, ``sim.sequence_parallel.auto_cp_mode``, for one of these first.)"""
    cp, mode = options.cp, options.cp_mode
    if mode not in CP_MODES:
        raise ValueError(f"--cp-mode must be one of {CP_MODES}, got {mode!r}")
    if options.ulysses_degree is not None and mode != "usp":
        raise ValueError(f"--ulysses-degree is for --cp-mode usp (got --cp-mode {mode})")
    if mode == "usp":
        u = options.ulysses_degree
        if u is None or not 1 < u < cp or cp % u:
            raise ValueError(f"--cp-mode usp needs --ulysses-degree U with 1 < U < cp and cp % U == 0 "
                             f"(cp = {cp}), got {u}")
        return u, f"usp: ulysses {u} x ring {cp // u}"
    u = cp if mode == "ulysses" else 1
    return u, f"{mode}: ulysses {u} x ring {cp // u}"


def model_config(options: TrainOptions):
    """The preset with --vocab-size; without it, the preset's vocabulary raised to what a byte-level BPE needs at
    least (the tiny presets' 128 tokens are fewer than its 256-byte alphabet)."""
    config = preset(options.preset)
    if options.mtp and config.arch != "deepseek_v3":
        raise ValueError(f"--mtp trains DeepSeek-V3's multi-token prediction module: it needs a DeepSeek-V3 preset "
                         f"(e.g. deepseek-v3-demo), got --preset {options.preset} ({config.arch})")
    return config.replace(vocab_size=options.vocab_size or max(config.vocab_size, MIN_VOCAB),
                          mtp_layers=1 if options.mtp else config.mtp_layers)


def validate(options: TrainOptions) -> None:
    for name in ("cp", "ep", "seqlen", "tokens_per_step", "steps", "eval_every", "save_every", "warmup", "log_every"):
        if getattr(options, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(options, name)}")
    if options.tokens_per_step % options.seqlen:
        raise ValueError(f"--tokens-per-step ({options.tokens_per_step}) must be a multiple of --seqlen ({options.seqlen})")
    if options.rows % options.ep:
        raise ValueError(f"--tokens-per-step / --seqlen = {options.rows} sequences must be divisible by --ep ({options.ep})")
    if options.layout not in LAYOUTS:
        raise ValueError(f"--layout must be one of {LAYOUTS}")
    ulysses, _ = sequence_split(options)
    config = model_config(options)
    try:
        check_heads(config.num_heads, config.num_heads if config.mla else config.num_kv_heads, ulysses)
    except ValueError as error:
        raise ValueError(f"--cp-mode {options.cp_mode} (ulysses {ulysses}): {error}") from None
    if not options.mtp_lambda > 0:
        raise ValueError(f"--mtp-lambda must be > 0, got {options.mtp_lambda}")
    if options.minutes is not None and not options.minutes > 0:
        raise ValueError(f"--minutes must be > 0, got {options.minutes}")
    if model_config(options).num_experts % options.ep:
        raise ValueError(f"--ep ({options.ep}) must divide the model's experts")
    if options.resume:
        checkpoint.latest(options.out)  # a dangling or incomplete latest, a pickled checkpoint: refused here
    parent = Path(options.out).expanduser().resolve().parent
    if not parent.is_dir():
        raise ValueError(f"--out {options.out}: the folder {str(parent)!r} does not exist")


def _prepare(options: TrainOptions, reuse_tokenizer: bool | None = None):
    """(train token lists, validation token lists, eos id, tokenizer folder) built in the parent.

    The tokenizer in ``out/tokenizer`` is trained anew unless reused (on --resume, or by ranks other than
    the one that trained it under torchrun)."""

    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    train_texts, val_texts = split_corpus(load_corpus(options.data, options.max_bytes))
    folder = out / "tokenizer"
    reuse = options.resume if reuse_tokenizer is None else reuse_tokenizer
    if not (reuse and (folder / "tokenizer.json").is_file()):
        folder.mkdir(exist_ok=True)
        train_tokenizer(train_texts, model_config(options).vocab_size, folder)
    tokenizer = Tokenizer(folder)
    if tokenizer.vocab_size > model_config(options).vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens, the model {model_config(options).vocab_size}")
    encode = lambda texts: [tokenizer.encode(t, add_special_tokens=False) for t in texts]  # noqa: E731
    return encode(train_texts), encode(val_texts), tokenizer.eos_token_ids[0], folder


def _flops_per_token(config, seqlen: int) -> float:
    """6 x active non-embedding parameters + causal attention (6 x layers x heads x head_dim x seqlen)."""
    active = config.active_params - config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    return 6 * active + 6 * config.num_layers * config.num_heads * config.head_dim * seqlen


def train_rank(rank: int, world: int, options: TrainOptions, train_docs, val_docs, eos: int, tokenizer_folder,
               progress=None) -> dict:

    torch.manual_seed(options.seed)
    mesh = make_mesh(options.cp, options.ep, ulysses=sequence_split(options)[0])
    config = model_config(options)
    model = MoETransformer(config, mesh, options.layout)
    model.init_weights(options.seed)
    settings = TrainConfig(rows=options.rows, lr=options.lr, warmup=options.warmup, steps=options.steps,
                           clip=options.clip, balance=options.balance, aux_coef=options.aux_coef,
                           bias_rate=options.bias_rate, bf16=options.bf16, mtp_lambda=options.mtp_lambda,
                           activation_checkpointing=options.activation_checkpointing)
    trainer = Trainer(model, settings, PackedStream(train_docs, options.seqlen, eos))
    validation = PackedStream(val_docs, options.seqlen, eos)
    out = Path(options.out)
    if options.resume:
        resumed = checkpoint.resume(trainer, out)  # CheckpointError on a dangling or incomplete latest
        if rank == 0:
            print(f"resumed from {checkpoint.latest(out)} at step {trainer.step_count}" if resumed else
                  f"--resume: {out} holds no checkpoint yet; starting from step 0", flush=True)
    saved = trainer.step_count if options.resume else None  # the step whose checkpoint is on disk
    flops = _flops_per_token(config, options.seqlen)
    metrics = (out / "metrics.jsonl").open("a") if rank == 0 else None
    started, last_eval = time.monotonic(), None
    while True:
        stop = torch.tensor([trainer.step_count >= options.steps or (
            options.minutes is not None and time.monotonic() - started > 60 * options.minutes)], dtype=torch.int64)
        if world > 1:
            dist.broadcast(stop, src=0)
        if bool(stop):
            break
        begin = time.perf_counter()
        row = trainer.step()
        seconds = time.perf_counter() - begin
        row["tokens_per_s"] = row["tokens"] / seconds
        row["mfu"] = row["tokens_per_s"] * flops / options.peak_flops  # the whole machine's peak
        if trainer.step_count % options.eval_every == 0 or trainer.step_count == options.steps:
            evaluation = trainer.evaluate_all(validation, options.eval_sequences)
            row.update(evaluation)
            last_eval = evaluation["val_loss"]
        if trainer.step_count % options.save_every == 0:
            checkpoint.save(trainer, out)
            saved = trainer.step_count
        if rank == 0:
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            if progress is not None:
                progress.put(row)
    if last_eval is None or "val_loss" not in row:
        evaluation = trainer.evaluate_all(validation, options.eval_sequences)
        last_eval = evaluation["val_loss"]
    if saved != trainer.step_count:  # the last step is saved once
        checkpoint.save(trainer, out)
    hf = checkpoint.export(model, out / "hf", tokenizer_folder, eos_token_id=eos)
    if rank == 0:
        metrics.close()
        _plot(out / "metrics.jsonl", out / "loss.png")
    return {"steps": trainer.step_count, "val_loss": last_eval, "hf": str(hf) if hf else None,
            **{k: v for k, v in evaluation.items() if k != "val_loss"}}


def _plot(metrics_file: Path, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train")
    evals = [r for r in rows if "val_loss" in r]
    ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss (nats)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_training(options: TrainOptions, console=None, launcher: str = "spawn") -> dict:
    """Prepare in this process, train on the local mesh (or, under torchrun, as this rank); rank 0's summary."""
    import multiprocessing as mp

    validate(options)
    world = options.cp * options.ep
    ulysses, why = sequence_split(options)
    if console is not None and options.cp > 1:
        console.print(f"sequence parallelism over cp = {options.cp}: {why}")
    if launcher == "torchrun":
        rank, size = join_torchrun(options.cp, options.ep, ulysses)
        if rank == 0:  # one rank trains the tokenizer; the others read it (the documents are deterministic)
            _prepare(options)
        dist.barrier()
        train_docs, val_docs, eos, tokenizer_folder = _prepare(options, reuse_tokenizer=True)
        try:
            result = train_rank(rank, size, options, train_docs, val_docs, eos, tokenizer_folder)
        finally:
            dist.destroy_process_group()
        result["unigram_entropy"] = unigram_entropy(val_docs)
        return result
    train_docs, val_docs, eos, tokenizer_folder = _prepare(options)
    updates = mp.get_context("fork").Queue()

    def show():
        while True:
            try:
                row = updates.get_nowait()
            except queue.Empty:
                return
            if console is not None and (row["step"] % options.log_every == 0 or "val_loss" in row
                                        or row["step"] == 1):
                line = (f"step {row['step']:5d}/{options.steps}  loss {row['loss']:.3f}  {row['tokens_per_s']:,.0f} tok/s  "
                        f"MFU {row['mfu']:.1%}  router imbalance {row['router_imbalance']:.2f}")
                if "mtp_loss" in row:
                    line += f"  mtp {row['mtp_loss']:.3f}"
                if "val_loss" in row:
                    line += f"  val {row['val_loss']:.3f}"
                if "mtp_draft_acceptance" in row:
                    line += f"  mtp val {row['mtp_val_loss']:.3f}, draft acceptance {row['mtp_draft_acceptance']:.0%}"
                console.print(line)

    threads = max(1, torch.get_num_threads() // world)
    try:
        result = spawn(train_rank, world, options, train_docs, val_docs, eos, tokenizer_folder, updates,
                       threads_per_rank=threads, timeout=None, on_poll=show)[0]
    finally:
        show()
        updates.close()
        updates.cancel_join_thread()
    result["unigram_entropy"] = unigram_entropy(val_docs)
    return result
