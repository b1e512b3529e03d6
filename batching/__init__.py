"""crossrl batching layer (see ../shared/DESIGN.md): data model, planning, padding, normalizers.

Pure numpy/torch on CPU tensors; never touches a device.
"""

from batching.data import PADDING_TOKEN_ID, Row, StepBatch

__all__ = ["PADDING_TOKEN_ID", "Row", "StepBatch"]
