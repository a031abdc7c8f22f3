"""Integrations of pyfedkern into FL frameworks (optional extras).

- :mod:`pyfedkern.integrations.flower`: Flower strategies, drop-in aggregation functions and ClientApp helpers
  (``pip install pyfedkern[flower]``). Importing :mod:`pyfedkern` never imports Flower.
"""
