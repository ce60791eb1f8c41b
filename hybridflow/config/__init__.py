"""L1: the configuration schema, YAML loading, dotted overrides, verl aliases and validation."""
