"""omni-actors: stage-disaggregated serving of multi-stage omni models on Thespian."""

__version__ = "0.1.0"
