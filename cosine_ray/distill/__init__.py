"""Distillation: drafters trained on the target's own answers (``cosine-ray distill``)."""
