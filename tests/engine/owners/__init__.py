"""Unit tests of each step owner alone (``cosine_ray.engine.owners``), built by
``support.factories``."""
