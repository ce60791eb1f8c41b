"""The single controller: the dataflow of stages, the RL/SFT/DPO loops, validation, metrics and loggers."""
