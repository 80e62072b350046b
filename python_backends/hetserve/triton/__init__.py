"""Triton Python-backend model implementations (model_repository/*/1/model.py import these)."""
