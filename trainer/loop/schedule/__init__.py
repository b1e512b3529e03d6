"""The controller's step and its phases (rollouts, update, step records) and when things happen:
pipeline, stream, backlog, validation, health."""
