"""The weight path from the training ranks to the engines: push, weight group, the push's tags."""
