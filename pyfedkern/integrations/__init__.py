"""Integrations of pyfedkern into FL frameworks (optional extras).

- :mod:`pyfedkern.integrations.flower`: Flower strategies, drop-in aggregation functions and ClientApp helpers
  (``pip install ".[flower]"`` from the checkout). Importing :mod:`pyfedkern` never imports Flower.
"""
