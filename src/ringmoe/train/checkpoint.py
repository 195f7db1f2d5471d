"""Training checkpoints (resume bitwise, never unpickled, never half-written) and the transformers export.

A checkpoint is a folder ``out/step-{N:06d}`` holding, for every rank r, ``rank{r}.safetensors`` (the
tensors: parameters and buffers, the optimizer's moments, the RNG state) and ``rank{r}.json`` (the rest:
step, data position, mesh, model config, optimizer hyper-parameters, learning-rate schedule), plus
``manifest.json`` (every file and its size), written last.  Nothing is pickled, so a crafted checkpoint
cannot run code.

Writes never lose the last good state:
1. every rank writes into ``step-N.tmp`` and fsyncs its files; rank 0 writes the manifest (fsync);
2. rank 0 renames an existing ``step-N`` aside to ``step-N.old``, renames ``step-N.tmp`` to ``step-N``,
   fsyncs ``out``, points ``out/latest`` at it (write ``latest.tmp``, fsync, rename, fsync) and only then
   deletes ``step-N.old``.
A kill at any point leaves ``latest`` naming a complete folder, or (between the two renames of a re-save)
naming ``step-N`` whose complete copy is still ``step-N.old``, which ``resume`` takes.

``resume`` refuses (``CheckpointError``, a ValueError: the CLI's one line and exit 2) when ``latest``
names a folder that is missing or incomplete, naming the newest complete step it found, and refuses
the pickled ``rank*.pt`` folders of earlier versions with the command that converts them
(``convert_legacy``: ``torch.load(weights_only=True)``, which builds only tensors and plain containers).
``export`` writes the transformers checkpoint through a staging folder the same way.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ..model import ModelConfig, MoETransformer
from ..model.export import save_pretrained
from .loop import Trainer

__all__ = ["save", "resume", "latest", "export", "complete_steps", "convert_legacy", "CheckpointError"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
FORMAT = "ringmoe-train-state/1"
MANIFEST = "manifest.json"
_STEP = re.compile(r"^step-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from (missing, incomplete, pickled, another mesh or model)."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier(model: MoETransformer) -> None:
    if model.mesh.size > 1:
        dist.barrier()


# -- durable files ----------------------------------------------------------------------------------
def _fsync(path: Path) -> None:
    """Flush a file's (or a folder's entries') bytes to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _replace_folder(staging: Path, final: Path) -> Path:
    """Put the complete ``staging`` folder at ``final``; an existing ``final`` goes aside (returned: the caller
    deletes it once nothing points at it).

    Without ``final`` an existing ``final.old`` is kept until then too: it is the complete copy ``latest`` resolves
    to when an earlier re-save was stopped between its two renames."""
    aside = final.with_name(final.name + ".old")
    if final.exists():  # complete (only ever made by renaming a complete staging folder): the old aside can go
        shutil.rmtree(aside, ignore_errors=True)
        final.rename(aside)
    staging.rename(final)
    _fsync(final.parent)
    return aside


def _point_latest(out: Path, name: str) -> None:
    pointer = out / "latest.tmp"
    _write_text(pointer, name + "\n")
    pointer.replace(out / "latest")
    _fsync(out)


# -- what a rank's state is, as tensors + JSON ----------------------------------------------------------
def _as_files(model_state: dict, optimizer: dict, rng: torch.Tensor, **meta) -> tuple[dict[str, torch.Tensor], dict]:
    """A rank's state as (safetensors tensors, JSON): the optimizer's per-parameter tensors go with the tensors,
    its numbers and hyper-parameters with the JSON."""
    tensors = {f"model/{name}": value.detach().contiguous() for name, value in model_state.items()}
    scalars: dict[str, dict] = {}
    for index, entry in optimizer["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer/{index}/{key}"] = value.detach().contiguous()
            else:
                scalars.setdefault(str(index), {})[key] = value
    tensors["rng"] = rng
    return tensors, {"format": FORMAT, **meta,
                     "optimizer": {"param_groups": optimizer["param_groups"], "scalars": scalars}}


def _state(trainer: Trainer) -> tuple[dict[str, torch.Tensor], dict]:
    model = trainer.model
    return _as_files(model.state_dict(), trainer.optimizer.state_dict(), torch.get_rng_state(),
                     step=trainer.step_count, position=trainer.position, mesh=[model.mesh.cp, model.mesh.ep],
                     config=_config_json(model.config), scheduler=trainer.scheduler.state_dict())


def _config_json(config) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(config)))


def _load_state(trainer: Trainer, tensors: dict[str, torch.Tensor], meta: dict, folder: Path) -> None:
    model = trainer.model
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{str(folder)!r} is not a ringmoe training checkpoint (format {meta.get('format')!r})")
    if tuple(meta["mesh"]) != (model.mesh.cp, model.mesh.ep):
        raise CheckpointError(f"checkpoint {str(folder)!r} was written on a cp x ep = {tuple(meta['mesh'])} mesh; "
                              f"this run is {model.mesh.cp} x {model.mesh.ep}")
    if meta["config"] != _config_json(model.config):
        changed = sorted(k for k, v in _config_json(model.config).items() if meta["config"].get(k) != v)
        raise CheckpointError(f"checkpoint {str(folder)!r} holds another model (fields that differ: {changed})")
    model.load_state_dict({name[len("model/"):]: value for name, value in tensors.items()
                           if name.startswith("model/")})
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        if name.startswith("optimizer/"):
            _, index, key = name.split("/", 2)
            state.setdefault(int(index), {})[key] = value
    for index, entry in meta["optimizer"]["scalars"].items():
        state.setdefault(int(index), {}).update(entry)
    groups = meta["optimizer"]["param_groups"]
    for group in groups:  # JSON made the tuples lists
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])
    trainer.optimizer.load_state_dict({"state": state, "param_groups": groups})
    trainer.scheduler.load_state_dict(meta["scheduler"])
    trainer.position, trainer.step_count = int(meta["position"]), int(meta["step"])
    torch.set_rng_state(tensors["rng"])


# -- save / find / resume ----------------------------------------------------------------------------
def save(trainer: Trainer, out: str | Path) -> Path:
    """Every rank writes its state; returns the checkpoint folder (collective).  Atomic: see the module."""
    model, out = trainer.model, Path(out)
    name = f"step-{trainer.step_count:06d}"
    staging, final = out / f"{name}.tmp", out / name
    if _rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier(model)
    tensors, meta = _state(trainer)
    rank = _rank()
    _write_rank(staging, f"rank{rank}", tensors, meta)
    _barrier(model)
    if rank == 0:
        _write_manifest(staging, trainer.step_count, model.mesh.size)
        aside = _replace_folder(staging, final)
        _point_latest(out, name)
        shutil.rmtree(aside, ignore_errors=True)
    _barrier(model)
    return final


def _write_rank(folder: Path, name: str, tensors: dict, meta: dict) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(folder / f"{name}.safetensors"))
    _fsync(folder / f"{name}.safetensors")
    _write_text(folder / f"{name}.json", json.dumps(meta))


def _write_manifest(folder: Path, step: int, ranks: int) -> None:
    """Last into a staging folder: every file and its size (what makes the folder complete)."""
    files = {f.name: f.stat().st_size for f in sorted(folder.iterdir())}
    _write_text(folder / MANIFEST, json.dumps({"format": FORMAT, "step": step, "ranks": ranks, "files": files}))
    _fsync(folder)


def _is_complete(folder: Path) -> bool:
    """The manifest is there and every file it lists has its size (written last, so a full save)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        return manifest.get("format") == FORMAT and all(
            (folder / name).is_file() and (folder / name).stat().st_size == size
            for name, size in manifest["files"].items())
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return False


def complete_steps(out: str | Path) -> list[Path]:
    """The complete checkpoint folders under ``out``, oldest first."""
    out = Path(out)
    found = [f for f in out.iterdir() if _STEP.match(f.name) and f.is_dir() and _is_complete(f)] \
        if out.is_dir() else []
    return sorted(found, key=lambda f: int(_STEP.match(f.name).group(1)))


def latest(out: str | Path) -> Path | None:
    """The complete checkpoint ``out/latest`` names (None when there is no pointer).

    Raises CheckpointError when the pointer names a missing or incomplete folder (never a silent fresh start),
    and for the pickled checkpoints of earlier versions."""
    out = Path(out)
    pointer = out / "latest"
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    folder = out / name
    if not _STEP.match(name):
        raise CheckpointError(f"{str(pointer)!r} names {name!r}, which is not a step folder")
    if any(folder.glob("rank*.pt")) and not (folder / MANIFEST).is_file():
        raise CheckpointError(f"{str(folder)!r} is a pickled checkpoint of an earlier ringmoe, which is not loaded "
                              f"(unpickling can run code); convert it with: ringmoe convert-checkpoint {folder}")
    for candidate in (folder, folder.with_name(name + ".old")):  # .old: a re-save stopped between its renames
        if _is_complete(candidate):
            return candidate
    steps = complete_steps(out)
    advice = (f"the newest complete checkpoint is {steps[-1].name}: resume from it with "
              f"`echo {steps[-1].name} > {pointer}`" if steps else "no complete checkpoint is there")
    raise CheckpointError(f"--resume: {str(pointer)!r} names {name}, which is missing or incomplete; {advice}")


def resume(trainer: Trainer, out: str | Path) -> bool:
    """Load the latest complete checkpoint into ``trainer`` (every rank); False if ``out`` has none.

    CheckpointError (on every rank, before any collective) when ``latest`` is dangling or the state does
    not fit this run."""
    from safetensors import safe_open

    folder = latest(out)
    if folder is None:
        return False
    rank = _rank()
    meta = json.loads((folder / f"rank{rank}.json").read_text())
    with safe_open(folder / f"rank{rank}.safetensors", framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    _load_state(trainer, tensors, meta, folder)
    return True


def convert_legacy(folder: str | Path) -> Path:
    """Rewrite a pickled checkpoint folder (``rank*.pt`` of ringmoe 0.1) in this format, in place.

    The pickles are read with ``torch.load(weights_only=True)``: only tensors, numbers, strings and
    containers can come out (the one class allowed besides is ringmoe's frozen ModelConfig)."""
    folder = Path(folder)
    ranks = sorted(folder.glob("rank*.pt"))
    if not ranks:
        raise CheckpointError(f"{str(folder)!r} holds no rank*.pt files to convert")
    staging = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    for path in ranks:
        try:
            with torch.serialization.safe_globals([ModelConfig]):
                old = torch.load(path, weights_only=True, map_location="cpu")
        except Exception as error:  # the unpickler met something other than tensors and containers
            shutil.rmtree(staging, ignore_errors=True)
            raise CheckpointError(f"{str(path)!r} holds more than tensors and plain data, so it is not converted: "
                                  f"{str(error).splitlines()[0]}") from None
        tensors, meta = _as_files(old["model"], old["optimizer"], old["rng"], step=old["step"],
                                  position=old["position"], mesh=list(old["mesh"]), config=_config_json(old["config"]),
                                  scheduler=old["scheduler"])
        _write_rank(staging, path.stem, tensors, meta)
    _write_manifest(staging, meta["step"], len(ranks))
    aside = _replace_folder(staging, folder)
    shutil.rmtree(aside, ignore_errors=True)
    return folder


@torch.no_grad()
def export(model: MoETransformer, folder: str | Path, tokenizer_folder: str | Path | None = None,
           eos_token_id: int | None = None) -> Path | None:
    """Write the whole model as a transformers checkpoint on rank 0 (collective); the folder there, else None.

    Written into ``folder.tmp`` and renamed into place (an existing folder is replaced only once the new
    one is complete)."""
    full = MoETransformer(model.config)
    state = dict(model.state_dict())
    for index, layer in model.moe_layers(with_mtp=True):
        for name, local in layer.mlp.experts.named_parameters():
            stack = local.new_zeros(model.config.num_experts, *local.shape[1:])
            stack[layer.mlp.slot_experts] = local
            if model.mesh.ep_group is not None:
                dist.all_reduce(stack, group=model.mesh.ep_group)
            state[f"{model.layer_name(index)}.mlp.experts.{name}"] = stack
    if _rank() != 0:
        return None
    full.load_state_dict(state)
    folder = Path(folder)
    staging = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    save_pretrained(full.to(model.embed_tokens.weight.dtype), staging, eos_token_id=eos_token_id)
    if tokenizer_folder is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_folder) / name).is_file():
                shutil.copyfile(Path(tokenizer_folder) / name, staging / name)
    for file in staging.iterdir():
        _fsync(file)
    _fsync(staging)
    aside = _replace_folder(staging, folder)
    shutil.rmtree(aside, ignore_errors=True)
    return folder
