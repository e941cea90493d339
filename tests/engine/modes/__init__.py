"""Tests of the decoding modes beside CoSine (``cosine_ray.engine.modes``): PEARL, PipeDec, twins."""
