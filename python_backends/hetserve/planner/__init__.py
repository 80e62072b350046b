"""Design-space planner for prefill/decode-disaggregated serving (``hetserve plan``).

``profiles`` holds the model/hardware/link/KV-tier tables, ``model`` the analytical cost model, the
search (:func:`plan`) and calibration (:func:`calibrate`), ``cli`` the command line.
"""
from .model import (
    SLO, Deployment, LengthDist, Measurements, Phase, PlanResult, PlanWarning, Prediction, SearchSpace,
    Workload, calibrate, calibrate_link, calibration_report, measurement_predictions, plan, predict,
)
from .profiles import HARDWARE, KV_TIERS, LINKS, MODELS, HardwareProfile, KVTier, LinkProfile, ModelConfig

__all__ = [
    "SLO", "Deployment", "LengthDist", "Measurements", "Phase", "PlanResult", "PlanWarning", "Prediction",
    "SearchSpace", "Workload", "calibrate", "calibrate_link", "calibration_report", "measurement_predictions",
    "plan", "predict", "HARDWARE", "KV_TIERS", "LINKS", "MODELS", "HardwareProfile", "KVTier", "LinkProfile",
    "ModelConfig",
]
