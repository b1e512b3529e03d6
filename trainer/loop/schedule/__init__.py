"""The controller's step and when things happen: pipeline, stream, backlog, validation, health."""
