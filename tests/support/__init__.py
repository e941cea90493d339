"""What the tests share that is not a test: fakes, factories, reference decoders, servers.

``tests/`` is on ``sys.path`` (``pythonpath`` in pyproject's pytest settings), so a test module
imports these as ``from support.fakes import TableTarget``. Nothing here is collected as a
test; fixtures stay in ``tests/conftest.py``.
"""
