"""The weight path from the training ranks to the engines: the driver's side, push, weight group,
the push's tags."""
