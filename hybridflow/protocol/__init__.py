"""L0: the ``Batch`` that flows between the driver and the workers."""

from hybridflow.protocol.batch import Batch

__all__ = ["Batch"]
