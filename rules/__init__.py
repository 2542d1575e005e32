"""kvdoctor's rule catalogue: one module per rule, named after its id (``kv-budget-exhausted`` →
``kv_budget_exhausted.py``), each with a ``RULE`` (:class:`kvdoctor.rulekit.Rule`) and its
documentation as the module docstring. Shipped as ``kvdoctor.rules``; loaded by
:func:`kvdoctor.rulekit.load_rules`."""
