"""Model families declared as data (see :mod:`runtime.model.families.family`)."""
