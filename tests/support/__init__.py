"""Helpers the tests share: tiny models, batches and rows that look real, multi-rank and Ray runners, CLI cases.

``tests/`` is on ``sys.path`` while pytest runs (its ``conftest.py`` lives there), so tests import these as
``from support.realistic import realistic_rows``; processes the helpers start (``dist_util``'s spawned ranks)
inherit that path.
"""
