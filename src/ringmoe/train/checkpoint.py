"""Training checkpoints (resume bitwise) and the transformers export.

``save`` writes ``out/step-{N}/rank{r}.pt`` for every rank (its parameters and buffers, optimizer and
schedule state, data position, RNG state) into ``step-{N}.tmp`` first; after every rank has written,
rank 0 renames the folder and then points ``out/latest`` at it (write-and-rename), so a run killed
during a save leaves the previous checkpoint as the latest one.  ``resume`` loads the latest complete
checkpoint on every rank.  ``export`` gathers the experts over the ep group and writes a transformers
checkpoint (config.json, model.safetensors) plus the tokenizer files, which ``ringmoe serve`` serves.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ..model import MoETransformer
from ..model.export import save_pretrained
from .loop import Trainer

__all__ = ["save", "resume", "latest", "export"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier(model: MoETransformer) -> None:
    if model.mesh.size > 1:
        dist.barrier()


def latest(out: str | Path) -> Path | None:
    """The newest complete checkpoint folder under ``out`` (None if there is none)."""
    pointer = Path(out) / "latest"
    if not pointer.is_file():
        return None
    folder = Path(out) / pointer.read_text().strip()
    return folder if folder.is_dir() else None


def save(trainer: Trainer, out: str | Path) -> Path:
    """Every rank writes its state; returns the checkpoint folder (collective)."""
    model, out = trainer.model, Path(out)
    name = f"step-{trainer.step_count:06d}"
    staging, final = out / f"{name}.tmp", out / name
    if _rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier(model)
    state = {
        "model": model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(), "position": trainer.position, "step": trainer.step_count,
        "rng": torch.get_rng_state(), "mesh": (model.mesh.cp, model.mesh.ep), "config": model.config,
    }
    torch.save(state, staging / f"rank{_rank()}.pt")
    _barrier(model)
    if _rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        pointer = out / "latest.tmp"
        pointer.write_text(name + "\n")
        pointer.replace(out / "latest")
    _barrier(model)
    return final


def resume(trainer: Trainer, out: str | Path) -> bool:
    """Load the latest complete checkpoint into ``trainer`` (every rank); False if there is none."""
    folder = latest(out)
    if folder is None:
        return False
    model = trainer.model
    state = torch.load(folder / f"rank{_rank()}.pt", weights_only=False)
    if tuple(state["mesh"]) != (model.mesh.cp, model.mesh.ep):
        raise ValueError(f"checkpoint {str(folder)!r} was written on a cp x ep = {state['mesh']} mesh; this run is "
                         f"{model.mesh.cp} x {model.mesh.ep}")
    model.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.position, trainer.step_count = state["position"], state["step"]
    torch.set_rng_state(state["rng"])
    return True


@torch.no_grad()
def export(model: MoETransformer, folder: str | Path, tokenizer_folder: str | Path | None = None,
           eos_token_id: int | None = None) -> Path | None:
    """Write the whole model as a transformers checkpoint on rank 0 (collective); the folder there, else None."""
    full = MoETransformer(model.config)
    state = dict(model.state_dict())
    for index, layer in model.moe_layers():
        for name, local in layer.mlp.experts.named_parameters():
            stack = local.new_zeros(model.config.num_experts, *local.shape[1:])
            stack[layer.mlp.slot_experts] = local
            if model.mesh.ep_group is not None:
                dist.all_reduce(stack, group=model.mesh.ep_group)
            state[f"layers.{index}.mlp.experts.{name}"] = stack
    if _rank() != 0:
        return None
    full.load_state_dict(state)
    folder = Path(folder)
    save_pretrained(full.to(model.embed_tokens.weight.dtype), folder, eos_token_id=eos_token_id)
    if tokenizer_folder is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_folder) / name).is_file():
                shutil.copyfile(Path(tokenizer_folder) / name, folder / name)
    return folder
