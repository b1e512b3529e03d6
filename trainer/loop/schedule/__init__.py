"""The controller's step and what decides when things happen: pipeline, stream, backlog, validation timing, health."""
