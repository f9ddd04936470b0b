"""envace: multi-turn tool-use RL on verl."""
__version__ = "0.1.0"
