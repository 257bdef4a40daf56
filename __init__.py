"""ninfer-bench: an inference engine for the Qwen3.5 / Qwen3-Next hybrid family and its benchmark harness."""

__version__ = "0.1.0"
