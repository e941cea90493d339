"""Unit tests of each step owner alone (``cosine_ray.engine.owners``), built by
``support.factories``. A package, so its module names (``test_routing``, ``test_economics``)
do not clash with the algorithm tests' of the same name."""
