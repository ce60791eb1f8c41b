"""L6: the ``hybridflow`` command line."""
