"""`python -m transformer_mt` runs the `tmt` app; torchrun needs this form (`torchrun -m transformer_mt train ...`)."""

from transformer_mt.cli import app

if __name__ == "__main__":
    app()
