"""The MoE transformer on a cp x ep mesh: config and presets, model, checkpoint loading and export."""

from .checkpoint import LoadReport, check_checkpoint, load_checkpoint, load_config, load_weights
from .config import PRESETS, ModelConfig, config_from_hf, preset
from .export import config_to_hf, save_pretrained
from .quantize import quantize_model
from .transformer import MoETransformer

__all__ = ["ModelConfig", "PRESETS", "preset", "config_from_hf", "MoETransformer", "load_checkpoint",
           "load_config", "load_weights", "check_checkpoint", "LoadReport", "save_pretrained", "config_to_hf", "quantize_model"]
