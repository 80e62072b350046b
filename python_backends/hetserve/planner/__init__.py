"""Design-space planner for prefill/decode-disaggregated serving (``hetserve plan``).

``profiles`` holds the model/hardware/link/KV-tier tables, ``model`` the analytical cost model
(:func:`predict`), ``search`` the design-space search (:func:`plan`), ``calibration`` the fit to measurements
(:func:`calibrate`), ``measure`` the measurement of live servers and the held-out check of the calibration,
``cli`` the command line.
"""
from .calibration import (
    Measurements,
    calibrate,
    calibrate_link,
    calibrate_links,
    calibration_report,
    measurement_predictions,
    predict_points,
)
from .model import SLO, Deployment, LengthDist, Phase, PlanWarning, Routing, Workload
from .predict import Prediction, predict
from .profiles import HARDWARE, KV_TIERS, LINKS, MODELS, HardwareProfile, KVTier, LinkProfile, ModelConfig
from .search import PlanResult, SearchSpace, plan

__all__ = [
    "SLO", "Deployment", "LengthDist", "Measurements", "Phase", "PlanResult", "PlanWarning", "Prediction", "Routing",
    "SearchSpace", "Workload", "calibrate", "calibrate_link", "calibrate_links", "calibration_report",
    "measurement_predictions", "plan", "predict", "predict_points",
    "HARDWARE", "KV_TIERS", "LINKS", "MODELS", "HardwareProfile", "KVTier", "LinkProfile",
    "ModelConfig",
]
