"""crossrl batching layer (see DESIGN.md): data model, planning, padding, normalizers.

Pure numpy/torch on CPU tensors; never touches a device.
"""

from batching.data import StepBatch
from batching.metrics import real_row_mean, response_length_mean, trajectory_score_mean
from batching.normalizers import LOSS_AGG_MODES, LossNormalizers, aggregate_loss, loss_normalizers
from batching.padding import PADDING_TOKEN_ID
from batching.planner import MiniBatchPlan, Plan, plan_minibatches
from batching.rows import Row
from batching.sharing import PromptSharing, share_prompts
from batching.stats import plan_stats

__all__ = [
    "LOSS_AGG_MODES",
    "PADDING_TOKEN_ID",
    "LossNormalizers",
    "MiniBatchPlan",
    "Plan",
    "PromptSharing",
    "Row",
    "StepBatch",
    "aggregate_loss",
    "loss_normalizers",
    "plan_minibatches",
    "plan_stats",
    "real_row_mean",
    "response_length_mean",
    "share_prompts",
    "trajectory_score_mean",
]
