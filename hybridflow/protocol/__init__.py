"""L0: the ``Batch`` that flows between the driver and the workers."""
