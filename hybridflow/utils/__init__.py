"""L0 helpers: logging, timers, seeding, masked tensor statistics, distributed helpers.

Import from the submodules (``hybridflow.utils.torch_functional`` and so on): this package stays free of
eager torch imports so that light commands (``hybridflow config show``) start fast.
"""
