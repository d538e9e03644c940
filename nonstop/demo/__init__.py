"""The demo job: a small decoder-only transformer trained on generated data."""
