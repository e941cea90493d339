"""Tests of the drafters (``cosine_ray.engine.drafters``): each drafter alone, its datastore, chains of fused drafts."""
