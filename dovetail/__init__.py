"""dovetail: RL post-training for generative models that keeps every device busy."""

__version__ = "0.1.0"
