"""Drafters that run a network: a small LM, a distilled domain drafter, a feature head (EAGLE)."""
