"""transformer_mt: the Transformer of "Attention Is All You Need", trained and evaluated as the paper did."""

__version__ = "0.1.0"
