"""The weight path from the training ranks to the engines: the driver's side, the ranks' end
(push, gather), the engines' end (``engine_weights``), the weight group, the push's tags."""
