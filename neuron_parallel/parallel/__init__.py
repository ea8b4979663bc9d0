"""Parallelism applied to model stages: ``tensor`` (tensor/sequence parallelism) and
``pipeline`` (pipeline parallelism)."""
