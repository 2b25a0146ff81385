"""Task families: one module per family, each a ``TaskFamily`` (``base.py``) registered by name in ``FAMILIES``
(``node/judging/tasks.py``). Built in: ``arithmetic``, ``addition``, ``dataset``,
``reasoning_gym``, ``verifiers``."""
