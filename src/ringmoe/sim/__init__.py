"""Cluster-scale cost model: ring attention and expert parallelism scheduled as events on a hardware profile."""

from .calibrate import calibrate_this_machine, profile_from_measurements, synthetic_measurements
from .costs import min_tokens_for_overlap, ring_step_pairs, visible_pairs
from .events import Timeline
from .hardware import PROFILES, Hardware, hardware_profile
from .simulate import Prediction, Scenario, simulate

__all__ = ["Hardware", "PROFILES", "hardware_profile", "Scenario", "Prediction", "simulate", "Timeline",
           "visible_pairs", "ring_step_pairs", "min_tokens_for_overlap", "calibrate_this_machine",
           "profile_from_measurements", "synthetic_measurements"]
