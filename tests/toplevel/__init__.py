"""Tests of nonstop/'s top-level modules (mesh.py, slurm.py, workerlog.py, ...)."""
