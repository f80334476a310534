"""Metrics (Prometheus, names from services/contract.py) and traces (OpenTelemetry) of the services."""
