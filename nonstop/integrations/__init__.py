"""Frameworks that own the training loop, hosted by nonstop (``Session.steps(..., wrap=False)``).

One module per framework, imported only by a script that uses it (the framework is not a
dependency of nonstop): :mod:`nonstop.integrations.accelerate` (Hugging Face Accelerate).
"""
